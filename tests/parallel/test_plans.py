"""Parallel plans on gloo: two (and four) processes started as torchrun starts them (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each an ``LLM`` with ``parallel=ep2`` / ``dp2`` ..., give
the outputs of one process token for token (batch-invariant mode): greedy, seeded and unseeded
sampling; under expert parallelism each rank holds only its share of the routed experts, under
data parallelism only its share of the requests; plans are refused where they cannot run."""
import gc
import hashlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.parallel.context import balanced_rows
from deepinfer.parallel.expert import local_experts
from deepinfer.parallel.groups import leave

LONG_PROMPT = "".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))
"""About 700 tokens: three prefill chunks, the indexer choosing among more keys than it keeps."""
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range("]
COMMON = ["engine.batch_invariant=true", "engine.use_tqdm=false", "engine.max_num_seqs=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(llm: LLM, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.token_ids) for o in outputs]


def _sampled(llm: LLM, prompts: list[str] = PROMPTS) -> list[tuple[int, list[int]]]:
    """Unseeded and seeded sampling (temperature 1) of every prompt: request ids and tokens."""
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=None if i % 2 else 7 + i)
              for i in range(len(prompts))]
    return [(o.request_id, list(o.token_ids)) for o in llm.generate(prompts, params)]


def _rank(rank: int, world: int, port: int, plan: str, out_dir: str, extra: list[str],
          prompts: list[str] = PROMPTS) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        llm = LLM("tiny", overrides=[f"parallel={plan}", *COMMON, *extra])
        held = {name: p.shape[0] for name, p in llm.model.named_parameters() if name.endswith("experts.w1")}
        placements = [[m.placement.physical_to_logical.tolist() for m in llm.balancing.maps]]
        ran, enqueue, forward, split = [], llm._enqueue, llm.model.forward, []
        llm._enqueue = lambda request: (ran.append(request.request_id), enqueue(request))[1]
        llm.model.forward = lambda ctx, caches: (
            split.append((ctx.num_tokens, ctx.shard.full.num_tokens)) if ctx.shard is not None else None,
            forward(ctx, caches))[1]
        tokens = _generate(llm, prompts)
        llm._enqueue, llm.model.forward = enqueue, forward
        placements.append([m.placement.physical_to_logical.tolist() for m in llm.balancing.maps])
        caches = llm.runner.caches
        digest = hashlib.sha256(b"".join(
            getattr(layer, name).contiguous().view(torch.uint8).numpy().tobytes()
            for layer in [*caches.layers, *caches.draft_layers]
            for name in ("swa_ring", "compressed", "index_k", "compress_state") if getattr(layer, name) is not None))
        activations = {m.activation_format for m in llm.model.modules() if isinstance(m, MoE)}
        torch.save({"tokens": tokens, "held": held, "ran": ran, "sampled": _sampled(llm, prompts), "placements": placements,
                    "split": split, "caches": digest.hexdigest(), "activations": activations},
                   Path(out_dir) / f"rank{rank}.pt")
        leave(llm.groups)
        del llm, enqueue
        gc.collect()  # the process group's last references go before the interpreter's teardown
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tmp_path, plan: str, world: int, extra: list[str] = (), prompts: list[str] = PROMPTS) -> list[dict]:
    mp.spawn(_rank, args=(world, _free_port(), plan, str(tmp_path), list(extra), prompts), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def single_process():
    llm = LLM("tiny", overrides=COMMON)
    return {"tokens": _generate(llm, PROMPTS), "sampled": _sampled(llm)}


@pytest.mark.multirank
@pytest.mark.parametrize("plan, world", [("dp2", 2)])
def test_data_parallel_outputs_equal_one_process_on_every_rank(tmp_path, single_process, plan, world):
    """Greedy tokens, and unseeded and seeded samples (each request keeps the id and seed it gets
    in one process), in prompt order on every rank."""
    for rank, result in enumerate(_run(tmp_path, plan, world)):
        assert result["tokens"] == single_process["tokens"], f"rank {rank} of {plan}"
        assert result["sampled"] == single_process["sampled"], f"rank {rank} of {plan}"
        assert result["ran"] == list(range(rank, len(PROMPTS), world)), f"rank {rank} ran {result['ran']}"


@pytest.mark.multirank
@pytest.mark.parametrize("plan, world", [("ep2", 2), pytest.param("ep4", 4, marks=pytest.mark.slow)])
def test_expert_parallel_greedy_tokens_equal_one_process(tmp_path, single_process, plan, world):
    results = _run(tmp_path, plan, world)
    single = LLM("tiny", overrides=COMMON)
    full = {name: p.shape[0] for name, p in single.model.named_parameters() if name.endswith("experts.w1")}
    for rank, result in enumerate(results):
        assert result["tokens"] == single_process["tokens"], f"rank {rank} of {plan}"
        assert result["held"] == {name: count // world for name, count in full.items()}, f"rank {rank} of {plan}"


@pytest.mark.multirank
def test_expert_parallel_with_fp8_expert_activations_equals_one_process(tmp_path):
    """Quantized experts (MXFP4) fed FP8 activations: each rank casts the rows it receives, which
    are the rows one process casts, so the tokens are one process's."""
    extra = ["model.weight_format=mxfp4", "model.expert_activation_format=fp8"]
    want = _generate(LLM("tiny", overrides=[*COMMON, *extra]), PROMPTS)
    for rank, result in enumerate(_run(tmp_path, "ep2", 2, extra)):
        assert result["activations"] == {"fp8"}, f"rank {rank} of ep2"
        assert result["tokens"] == want, f"rank {rank} of ep2"


@pytest.mark.multirank
def test_data_and_expert_parallel_together_equal_one_process(tmp_path, single_process):
    """dp2_ep2: each rank runs its half of the requests and holds half of the experts; while one
    rank has nothing left to run it takes part in the other's MoE exchanges (the prompts finish at
    different steps, as their lengths differ)."""
    for rank, result in enumerate(_run(tmp_path, "dp2_ep2", 2, ["parallel.num_extra_experts=2",
                                                               "parallel.eplb_interval=4"])):
        assert result["tokens"] == single_process["tokens"], f"rank {rank}"
        assert result["sampled"] == single_process["sampled"], f"rank {rank}"
        assert result["ran"] == list(range(rank, len(PROMPTS), 2)), f"rank {rank} ran {result['ran']}"
        assert set(result["held"].values()) == {5, 3}


@pytest.mark.multirank
def test_eplb_rebalancing_mid_run_moves_experts_and_keeps_the_outputs(tmp_path, single_process):
    """Two redundant experts a layer (10 physical slots of 8 experts, 6 of the draft layer's 4),
    re-placed every 3 steps from the routed counts: the placement changes during the run, and the
    greedy tokens and the samples stay those of one process."""
    extra = ["parallel.num_extra_experts=2", "parallel.eplb_interval=3"]
    for rank, result in enumerate(_run(tmp_path, "ep2", 2, extra)):
        assert result["tokens"] == single_process["tokens"], f"rank {rank}"
        assert result["sampled"] == single_process["sampled"], f"rank {rank}"
        initial, final = result["placements"]
        assert len(initial) == 5 and initial != final, f"rank {rank}: {initial} -> {final}"
        assert all(sorted(set(p)) == list(range(len(set(p)))) for p in final)  # every expert keeps a slot
        assert set(result["held"].values()) == {5, 3}


@pytest.mark.multirank
def test_expert_parallel_with_dspark_equals_one_process(tmp_path):
    extra = ["decoding=dspark", "decoding.varlen=false"]
    want = _generate(LLM("tiny", overrides=[*COMMON, *extra]), PROMPTS)
    for rank, result in enumerate(_run(tmp_path, "ep2", 2, extra)):
        assert result["tokens"] == want, f"rank {rank}"


@pytest.mark.multirank
@pytest.mark.parametrize("plan, world", [("cp2", 2), pytest.param("cp4", 4, marks=pytest.mark.slow)])
def test_context_parallel_outputs_equal_one_process(tmp_path, plan, world):
    """Every rank runs every request; each prefill step's rows are split evenly over the ranks
    (each computes about 1/world of them), every rank ends with the same cache, bit for bit, and
    the greedy tokens and samples are one process's."""
    prompts = [*PROMPTS, LONG_PROMPT]
    single = LLM("tiny", overrides=COMMON)
    want = {"tokens": _generate(single, prompts), "sampled": _sampled(single, prompts)}
    results = _run(tmp_path, plan, world, prompts=prompts)
    for rank, result in enumerate(results):
        assert result["tokens"] == want["tokens"], f"rank {rank} of {plan}"
        assert result["sampled"] == want["sampled"], f"rank {rank} of {plan}"
        assert result["ran"] == list(range(len(prompts))), f"rank {rank} ran {result['ran']}"
        assert result["split"], f"rank {rank} of {plan} split no prefill step"
        assert result["caches"] == results[0]["caches"], f"rank {rank}'s cache replica differs from rank 0's"
        for mine, whole in result["split"]:
            assert abs(mine - whole / world) <= 2 * len(prompts), f"rank {rank}: {mine} of {whole} rows"


@pytest.mark.multirank
def test_context_parallel_with_dspark_and_bounded_replay_equals_one_process(tmp_path):
    """DSpark's draft caches and bounded replay's consumer windows (compact replay runs masked
    under CP, with the same values) from split prefill steps."""
    extra = ["decoding=dspark", "decoding.varlen=false", "engine.bounded_replay.mode=compact",
             "engine.prefill_chunk_tokens=128"]
    prompts = [*PROMPTS, LONG_PROMPT]
    want = _generate(LLM("tiny", overrides=[*COMMON, *extra]), prompts)
    for rank, result in enumerate(_run(tmp_path, "cp2", 2, extra, prompts)):
        assert result["tokens"] == want, f"rank {rank}"


@pytest.mark.multirank
def test_data_and_expert_parallel_with_dspark_equals_one_process(tmp_path):
    """A rank with nothing to draft while its peer drafts (or nothing to run at all) takes part in
    the draft layers' MoE exchanges."""
    extra = ["decoding=dspark", "parallel.num_extra_experts=2", "parallel.eplb_interval=4"]
    want = _generate(LLM("tiny", overrides=[*COMMON, *extra[:1]]), PROMPTS)
    for rank, result in enumerate(_run(tmp_path, "dp2_ep2", 2, extra)):
        assert result["tokens"] == want, f"rank {rank}"
        assert result["ran"] == list(range(rank, len(PROMPTS), 2)), f"rank {rank} ran {result['ran']}"


@pytest.mark.multirank
@pytest.mark.parametrize("plan, extra", [
    ("ep2", ["parallel.num_extra_experts=2", "parallel.eplb_interval=4"]), ("dp2", []),
    pytest.param("cp2", [], marks=pytest.mark.slow),  # two ranks: test_context_parallel_outputs_equal_one_process
    ("dp2_ep2", [])])
def test_a_plan_on_one_process_runs_its_groups_and_equals_one_process(tmp_path, single_process, plan, extra):
    """``parallel.world_size=1`` (torchrun --nproc-per-node 1): the plan's collectives run through
    a process group of one rank (EPLB re-placing mid-run under ep2) and the outputs are the plain
    single-process run's."""
    prompts = [*PROMPTS, LONG_PROMPT] if plan == "cp2" else PROMPTS
    want = single_process if plan != "cp2" else None
    if want is None:
        single = LLM("tiny", overrides=COMMON)
        want = {"tokens": _generate(single, prompts), "sampled": _sampled(single, prompts)}
    (result,) = _run(tmp_path, plan, 1, ["parallel.world_size=1", *extra], prompts=prompts)
    assert result["tokens"] == want["tokens"]
    assert result["sampled"] == want["sampled"]
    if plan == "cp2":
        assert result["split"], "no prefill step went through the context group"
    if extra:
        assert result["placements"][0] != result["placements"][1], "EPLB did not re-place the replicas"


def test_balanced_rows_take_mirrored_pieces_of_each_sequence():
    """Two sequences of 8 and 5 rows over two ranks: pieces of 2 rows (8 rows) and 2 rows (5 rows:
    the last piece empty); rank 0 takes pieces 0 and 3, rank 1 pieces 1 and 2."""
    assert balanced_rows([8, 5], 0, 2).tolist() == [0, 1, 6, 7, 8, 9]
    assert balanced_rows([8, 5], 1, 2).tolist() == [2, 3, 4, 5, 10, 11, 12]
    every = sorted(row for rank in range(4) for row in balanced_rows([37, 1, 16], rank, 4).tolist())
    assert every == list(range(54))


def test_local_experts_are_contiguous_equal_shares():
    assert [local_experts(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="do not divide over 3 expert-parallel ranks"):
        local_experts(8, 3, 0)


def test_a_plan_launched_on_the_wrong_number_of_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match=r"parallel=ep2 runs on 2 processes.*torchrun --nproc-per-node 2"):
        LLM("tiny", overrides=["parallel=ep2", *COMMON])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"parallel=ep2 runs on 1 processes.*torchrun --nproc-per-node 1"):
        LLM("tiny", overrides=["parallel=ep2", "parallel.world_size=1", *COMMON])
    with pytest.raises(ValueError, match=r"parallel.world_size.*use 2 \(the plan's ranks\), 1"):
        LLM("tiny", overrides=["parallel=ep2", "parallel.world_size=3", *COMMON])


@pytest.mark.parametrize("override, message", [
    ("parallel=cp2 parallel.expert_parallel=2", "context parallelism together with attention DP or expert "
                                                "parallelism is not implemented yet"),
    ("parallel=ep2 decoding=dspark decoding.varlen=true", "set decoding.varlen=false"),
    ("parallel=cp2 decoding=dspark decoding.varlen=true", "set decoding.varlen=false"),
])
def test_plans_not_implemented_yet_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny", overrides=override.split())


@pytest.mark.parametrize("overrides, message", [
    (["parallel.num_extra_experts=2"], "needs expert parallelism"),
    (["parallel=ep2", "parallel.eplb_interval=5"], "set parallel.num_extra_experts too"),
    (["parallel=ep2", "parallel.eplb_window=0"], "must be >= 1"),
])
def test_bad_eplb_settings_are_refused(overrides, message):
    from deepinfer.config.compose import compose

    with pytest.raises(Exception, match=message):
        compose(["model=tiny", *overrides])


def _rank_then_die(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    llm = LLM("tiny", overrides=["parallel=ep2", *COMMON, "parallel.timeout_s=30"])
    if rank == 1:
        os._exit(3)  # a rank that dies before the run
    try:
        _generate(llm, PROMPTS)
        message = "finished"
    except RuntimeError as error:
        message = str(error)
    Path(out_dir, "rank0.txt").write_text(message)


@pytest.mark.multirank
def test_a_rank_that_dies_ends_the_run_with_an_error_naming_it(tmp_path):
    context = mp.start_processes(_rank_then_die, args=(_free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(120)
    assert [p.exitcode for p in context.processes] == [0, 3]
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("parallel=ep2: rank 0 of 2 lost its peers in a collective"), message


def test_an_npu_plan_joins_hccl_on_its_local_npu(monkeypatch):
    """The HCCL path with fakes (no NPU here): the process group's backend follows the device, and
    the rank's NPU is its LOCAL_RANK."""
    import types

    from deepinfer.config.compose import compose
    from deepinfer.parallel import groups

    joined, chosen = [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(groups.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(groups.dist, "init_process_group", lambda backend, timeout: joined.append(backend))
    monkeypatch.setattr(groups.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(set_device=chosen.append), raising=False)
    plan = compose(["parallel=ep2"]).parallel
    result = groups.join(plan, types.SimpleNamespace(type="npu"))  # torch.device("npu") needs torch_npu
    assert joined == ["hccl"] and chosen == [1]
    assert (result.rank, result.world) == (1, 2)
