"""The ascend950 native wrappers on a CPU, with a stand-in for ``tilelang``: the kernel builders
are recorded instead of run, and each "compiled" kernel checks the tensors it is given against
its ``prim_func``'s parameters (shape, dtype, contiguity, whole tiles) and computes its result with
the emulation. Checked: every case of the ops' tables either matches the reference (outputs and
the tensors the op writes in place) or is refused with the reason and the way around; the
builders get the plan's tile sizes and buffer offsets; compiles are kept by shape; without
``torch_npu`` the backend reports why it cannot run, importing neither it nor tilelang."""
import copy
import importlib
import subprocess
import sys
import types

import pytest
import torch

import deepinfer.hal.ops  # noqa: F401  (registers the op specs)
from deepinfer.hal import OpTable, UnsupportedInput
from deepinfer.hal.formats import (FP8_AMAX_FLOOR, MXFP4_AMAX_FLOOR, NVFP4_AMAX_FLOOR, Quantized, decode_tokens,
                                   encode_tokens, quantize)
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.ascend950 import Ascend950Backend
from deepinfer_backends.ascend950.buffers import AI_CORES, layout
from deepinfer_backends.ascend950.emulate import apply_rope as ar
from deepinfer_backends.ascend950.emulate import grouped_gemm as gg
from deepinfer_backends.ascend950.emulate import kv_norm_rope_store as kv
from deepinfer_backends.ascend950.emulate import mla
from deepinfer_backends.ascend950.emulate import rms_norm as rn
from deepinfer_backends.ascend950.native import launch

NATIVE = {"execution": "native"}
BUILDERS = ("rms_norm", "grouped_gemm", "grouped_gemm_fp8", "mla_sparse_decode", "mla_sparse_prefill", "apply_rope",
            "kv_norm_rope_store")
F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def _parameters(name: str, a: dict) -> list[tuple[str, tuple, torch.dtype]]:
    """The ``prim_func``'s parameters of builder ``name`` for arguments ``a``: (role, shape, dtype)."""
    if name == "rms_norm":
        rows, dim, dtype = a["rows"], a["dim"], getattr(torch, a["dtype"])
        return [("in", (rows, dim), dtype), ("in", (rows, dim), dtype), ("in", (1, dim), F32), ("out", (rows, dim), dtype)]
    if name.startswith("grouped_gemm"):
        rows, e, n, k = a["experts"] * a["segment_rows"], a["experts"], a["n"], a["k"]
        if name == "grouped_gemm":
            dtype = getattr(torch, a["dtype"])
            return [("in", (rows, k), dtype), ("in", (e, n, k), dtype),
                    ("ws", (a["cores"], 2, a["base_m"], a["base_n"]), F32), ("out", (rows, n), dtype)]
        fp8 = torch.float8_e4m3fn
        return [("in", (rows, k), fp8), ("in", (rows, k // 64), torch.int16), ("in", (e, n, k), fp8),
                ("in", (e, n, k // 64), torch.int16), ("ws", (a["cores"], a["base_m"], a["base_n"]), F32),
                ("out", (rows, n), F32)]
    if name.startswith("mla"):
        t, h, d, g, c = a["tokens"], a["heads"], a["dim"], a["head_group"], a["cores"]
        kv_param = ((a["kv_rows"], 528), torch.uint8) if a.get("cache_format") == "fp8" else ((a["kv_rows"], d), BF16)
        extra = [("in", (a["extra_rows"], {"fp8": 528, "fp4": 288}[a["extra_format"]]), torch.uint8)] \
            if a.get("extra_format") else []
        return [("in", (t, h, d), BF16), ("in", *kv_param), *extra, ("in", (t, a["topk"]), I32), ("in", (h,), F32),
                ("ws", (c, a["key_tile"], d), BF16), ("ws", (c, g, a["key_tile"]), F32),
                ("ws", (c, g, a["key_tile"]), BF16), ("ws", (c, g, d), F32), ("out", (t, h, d), BF16),
                ("out", (t, h), F32)]
    if name == "apply_rope":
        return [("in", (a["tokens"] * a["heads"], a["dim"]), BF16), ("in", (a["tokens"],), I32),
                ("in", (a["table_rows"], a["rope_dim"]), F32)]
    rows, dim = a["rows"], a["dim"]
    row_bytes = {"fp8": 528, "index_fp4": 68, "fp4": 288}
    cache = ((a["cache_rows"], row_bytes[a["fmt"]]), torch.uint8) if a["fmt"] in row_bytes \
        else ((a["cache_rows"], dim), BF16)
    return [("in", (rows, dim), BF16), ("in", (1, dim), F32), ("in", (rows,), I32),
            ("in", (a["table_rows"], a["rope_dim"]), F32), ("in", (rows,), I32), ("in", *cache),
            ("out", (rows, dim), BF16)]


def _whole_tiles(name: str, a: dict) -> bool:
    if name in ("rms_norm", "kv_norm_rope_store"):
        return a["rows"] % a["tile_rows"] == 0
    if name == "apply_rope":
        return a["tokens"] * a["heads"] % a["tile_rows"] == 0
    if name.startswith("grouped_gemm"):
        return a["segment_rows"] % a["base_m"] == 0 and a["n"] % a["base_n"] == 0 and \
            a["k"] % (a["base_k"] * a["stages"]) == 0
    return a["heads"] % a["head_group"] == 0 and a["topk"] % a["key_tile"] == 0 and a["dim"] % a["d_split"] == 0


def _emulate(name: str, a: dict, *inputs):
    """What kernel ``name`` computes from its inputs, by the emulation; in-place ones write back."""
    if name == "rms_norm":
        x, residual, weight = inputs
        normed, summed = rn.rms_norm(x, weight[0], a["eps"], residual)
        residual.copy_(summed)
        return [normed]
    if name == "grouped_gemm":
        return [gg.grouped_gemm(*inputs, torch.full((a["experts"],), a["segment_rows"]))]
    if name == "grouped_gemm_fp8":
        x, x_scale, w, w_scale = inputs
        blocks = a["k"] // 32
        return [gg.grouped_gemm(Quantized(x, gg.unpack_scales(x_scale, blocks), "fp8"),
                                Quantized(w, gg.unpack_scales(w_scale, blocks), "fp8"),
                                torch.full((a["experts"],), a["segment_rows"]))]
    if name.startswith("mla"):
        q, kv_rows, *extra, indices, sink = inputs
        main = a.get("main_keys", a["topk"])

        def keys_of(rows, fmt, at):
            picked = rows[at.clamp(min=0).long()]
            return decode_tokens(picked.reshape(-1, picked.shape[-1]), fmt).reshape(*at.shape, -1) \
                if fmt != "bf16" else picked.float()
        keys = keys_of(kv_rows, a.get("cache_format", "bf16"), indices if not extra else indices[:, :main])
        formats = [a.get("cache_format", "bf16")]
        if extra:
            keys = torch.cat((keys, keys_of(extra[0], a["extra_format"], indices[:, main:])), dim=1)
            formats.append(a["extra_format"])
        return list(mla.attend(q, keys, indices >= 0, sink, a["scale"], main,
                               cache_formats=tuple(dict.fromkeys(f for f in formats if f != "bf16"))))
    if name == "apply_rope":
        x, positions, table = inputs
        turned = ar.apply_rope(x.view(a["tokens"], a["heads"], a["dim"]), positions.long(), table, a["conjugate"])
        x.copy_(turned.view(x.shape))
        return []
    x, weight, positions, table, slots, cache = inputs
    keys = ar.apply_rope(rn.rms_norm(x, weight[0], a["eps"]), positions.long(), table)
    stored = slots >= 0
    if a["fmt"] in ("fp8", "index_fp4", "fp4"):
        floors = {"fp8": FP8_AMAX_FLOOR, "index_fp4": MXFP4_AMAX_FLOOR, "fp4": NVFP4_AMAX_FLOOR}
        assert a["amax_floor"] == floors[a["fmt"]]
        rows = encode_tokens(keys, a["fmt"])
        cache[slots[stored].long()] = rows[stored]
        return [decode_tokens(rows, a["fmt"]).to(keys.dtype)]
    cache[slots[stored].long()] = keys[stored]
    return [keys]


class FakeTilelang(types.ModuleType):
    """``tilelang`` with ``compile`` only: records each compile and returns a kernel that checks
    its tensors against the ``prim_func``'s parameters and computes with the emulation."""

    def __init__(self):
        super().__init__("tilelang")
        self.compiles, self.launches = [], []

    def compile(self, func, out_idx=None, workspace_idx=None, target="auto", platform="auto"):
        name, arguments = func
        self.compiles.append(dict(name=name, arguments=arguments, target=target, platform=platform))
        parameters = _parameters(name, arguments)
        assert sorted(out_idx or []) == [i for i, p in enumerate(parameters) if p[0] == "out"], name
        assert sorted(workspace_idx or []) == [i for i, p in enumerate(parameters) if p[0] == "ws"], name
        assert _whole_tiles(name, arguments), (name, arguments)

        def kernel(*inputs):
            wanted = [(shape, dtype) for role, shape, dtype in parameters if role == "in"]
            assert [(tuple(t.shape), t.dtype) for t in inputs] == wanted, name
            assert all(t.is_contiguous() for t in inputs), name
            self.launches.append(name)
            outputs = _emulate(name, arguments, *inputs)
            return outputs[0] if len(outputs) == 1 else outputs
        return kernel


@pytest.fixture
def fake(monkeypatch):
    """A fake available NPU (torch_npu), the tilelang stand-in, CPU tensors accepted, and the
    builders recorded: their arguments are what the stand-in's compile receives."""
    npu = types.SimpleNamespace(device_count=lambda: 1, get_device_name=lambda i: "Ascend950PR")
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    tilelang = FakeTilelang()
    monkeypatch.setitem(sys.modules, "tilelang", tilelang)
    monkeypatch.setattr(launch, "DEVICE_TYPE", "cpu")
    for name in BUILDERS:
        module = importlib.import_module(f"deepinfer_backends.ascend950.kernels.{name}")
        monkeypatch.setattr(module, f"{name}_kernel", lambda _name=name, **arguments: (_name, arguments))
    return tilelang


RUNS_NATIVELY = {"rms_norm": {"tiny_bf16_residual", "v41_hidden_bf16", "v41_latent_bf16"},
                 "grouped_gemm": {"tiny", "tiny_bf16", "tiny_fp8_fp8", "fp8_fp8_bf16", "no_rows",
                                  "empty_experts_bf16", "fp8_fp8_bf16_out", "fp8_fp8_float32_out"},
                 "mla_sparse_decode": {"tiny_bf16_bf16_cache", "tiny_bf16_fp8_fp4", "v41_bf16"},
                 "mla_sparse_prefill": {"tiny_bf16", "tiny_bf16_empty_rows"},
                 "apply_rope": {"tiny_bf16", "v41_query_tail_bf16"},
                 "kv_norm_rope_store": {"tiny_bf16_cache_bf16", "tiny_fp8_bf16", "v41_decode_fp8_bf16",
                                        "v41_prefill_fp8_bf16", "tiny_index_fp4_bf16", "v41_index_fp4_bf16",
                                        "tiny_fp4_bf16", "v41_compressed_fp4_bf16"}}
GRID = [(op, case.name) for op in RUNS_NATIVELY for case in SPECS[op].cases
        if case.size == "tiny" or case.name in RUNS_NATIVELY[op]]


@pytest.mark.parametrize("op, case", GRID, ids=[f"{op}-{case}" for op, case in GRID])
def test_each_case_matches_the_reference_or_is_refused_with_the_way_around(op, case, fake):
    spec = SPECS[op]
    args = spec.case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    want_args = copy.deepcopy(args)
    want = spec.reference(**want_args)
    impl = Ascend950Backend(NATIVE).implementations()[op]
    if case not in RUNS_NATIVELY[op]:
        with pytest.raises(UnsupportedInput, match=rf"^ascend950 native {op}: .*backend\.fallback=reference.*"
                                                   rf"backend\.execution=emulate"):
            impl(**args)
        assert not fake.compiles, "a refused input compiled a kernel"
        return
    got = impl(**args)
    tol = spec.case_tolerance(spec.case(case))
    failures = compare(got, want, tol)
    for name, value in args.items():  # what the op writes in place (the cache), and nothing else
        if isinstance(value, torch.Tensor):
            failures += compare(value, want_args[name], tol, f"argument {name}")
    assert not failures, "\n".join(failures)


def test_refused_inputs_run_on_the_configured_fallback(fake, caplog):
    x, w = torch.randn(5, 64), torch.randn(64)
    table = OpTable("ascend950", "reference", options=NATIVE)
    assert table.sources["rms_norm"] == "ascend950"
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), SPECS["rms_norm"].reference(x, w, 1e-6), rtol=0, atol=0)
    assert "the kernel normalises bf16 rows, got torch.float32" in caplog.text and not fake.compiles


def test_rms_norm_builds_with_the_plans_tile_and_offsets_and_compiles_once_a_shape(fake):
    impl = Ascend950Backend(NATIVE).implementations()["rms_norm"]
    dim = 512
    tile = rn.row_tile(dim, 2)
    x = torch.randn(tile + 3, dim).to(BF16)
    impl(x, torch.ones(dim), 1e-6)
    impl(x[:-1], torch.ones(dim), 1e-6)  # the same whole tiles: no new compile
    assert len(fake.compiles) == 1 and fake.launches == ["rms_norm", "rms_norm"]
    compiled = fake.compiles[0]
    assert (compiled["target"], compiled["platform"]) == ("pto", "A5")
    assert compiled["arguments"] == dict(rows=2 * tile, dim=dim, tile_rows=tile, vector_cores=2 * AI_CORES["A5"],
                                         eps=1e-6, offsets=layout(rn.plan_buffers(tile, dim, 2)), dtype="bfloat16")
    impl(torch.randn(2 * tile + 1, dim).to(BF16), torch.ones(dim), 1e-6)
    assert len(fake.compiles) == 2 and fake.compiles[1]["arguments"]["rows"] == 3 * tile


def test_grouped_gemm_pads_segments_n_and_k_to_the_plans_tiles(fake):
    gen = torch.Generator().manual_seed(1)
    sizes, n, k = torch.tensor([0, 130, 1, 0, 5]), 300, 200
    x, w = torch.randn(140, k, generator=gen).to(BF16), torch.randn(5, n, k, generator=gen).to(BF16)
    got = Ascend950Backend(NATIVE).implementations()["grouped_gemm"](x, w, sizes)
    t = gg.TILES[BF16]
    arguments = fake.compiles[0]["arguments"]
    assert (arguments["segment_rows"], arguments["n"], arguments["k"]) == (256, 512, 256)
    assert arguments["offsets"] == layout(t.buffers(2)) and arguments["cores"] == AI_CORES["A5"]
    assert torch.equal(got, gg.grouped_gemm(x, w, sizes)) and not got[136:].any()
    fp8 = [quantize(torch.randn(70, 256, generator=gen), "fp8"), quantize(torch.randn(2, 260, 256, generator=gen), "fp8")]
    got = Ascend950Backend(NATIVE).implementations()["grouped_gemm"](*fp8, torch.tensor([64, 6]))
    arguments = fake.compiles[1]["arguments"]
    assert fake.compiles[1]["name"] == "grouped_gemm_fp8" and arguments["k"] == 512
    assert arguments["offsets"] == layout(gg.TILES["fp8"].fp8_buffers(512))
    assert torch.equal(got, gg.grouped_gemm(*fp8, torch.tensor([64, 6])))


def test_mla_pads_heads_dim_and_each_list_to_whole_tiles(fake):
    gen = torch.Generator().manual_seed(2)
    q, kv = torch.randn(3, 5, 96, generator=gen).to(BF16), torch.randn(300, 96, generator=gen).to(BF16)
    indices = torch.randint(0, 300, (3, 100), generator=gen, dtype=I32)
    sink = torch.randn(5, generator=gen)
    out, lse = Ascend950Backend(NATIVE).implementations()["mla_sparse_prefill"](q, kv, indices, sink, 0.1, 30)
    arguments = fake.compiles[0]["arguments"]
    assert (arguments["heads"], arguments["dim"], arguments["main_keys"], arguments["topk"]) == (64, 128, 64, 192)
    assert arguments["offsets"] == layout(mla.buffers(128, 2, masked=True))
    want = mla.mla_sparse_prefill(q, kv, indices, sink, 0.1, 30)
    torch.testing.assert_close(lse, want[1], rtol=1e-5, atol=1e-5)
    assert compare(out, want[0], SPECS["mla_sparse_prefill"].tolerance(BF16)) == []


def test_mla_decode_reads_an_extra_fp4_list_from_its_own_cache(fake):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 3, 512, generator=gen).to(BF16)
    cache = encode_tokens(torch.randn(200, 512, generator=gen), "fp8")
    extra_cache = encode_tokens(torch.randn(300, 512, generator=gen), "fp4")
    indices = torch.randint(0, 200, (2, 1, 70), generator=gen, dtype=I32)
    extra_indices = torch.randint(-1, 300, (2, 1, 40), generator=gen, dtype=I32)
    sink = torch.randn(3, generator=gen)
    args = dict(q=q, cache=cache, indices=indices, sink=sink, scale=0.05, cache_format="fp8",
                extra_cache=extra_cache, extra_indices=extra_indices, extra_format="fp4")
    out, lse = Ascend950Backend(NATIVE).implementations()["mla_sparse_decode"](**args)
    (compiled,) = fake.compiles
    arguments = compiled["arguments"]
    assert (arguments["main_keys"], arguments["topk"], arguments["extra_rows"]) == (128, 192, 300)
    assert arguments["extra_format"] == "fp4" and arguments["cache_format"] == "fp8"
    assert arguments["offsets"] == layout(mla.buffers(512, 2, ("fp8", "fp4"), masked=True))
    want = SPECS["mla_sparse_decode"].reference(**args)
    torch.testing.assert_close(lse, want[1], rtol=1e-4, atol=1e-4)
    assert compare(out, want[0], SPECS["mla_sparse_decode"].tolerance(BF16)) == []
    with pytest.raises(UnsupportedInput, match=r"reads \['fp8', 'fp4'\] caches for the extra list, not 'index_fp4'"):
        Ascend950Backend(NATIVE).implementations()["mla_sparse_decode"](**{**args, "extra_format": "index_fp4"})


def test_rope_pads_whole_tokens_so_a_tiles_rows_are_whole(fake):
    from deepinfer.hal.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq

    x = torch.randn(7, 3, 128).to(BF16)
    positions, table = torch.randint(0, 64, (7,)), rope_cos_sin(rope_inv_freq(10000.0), 64)
    got = Ascend950Backend(NATIVE).implementations()["apply_rope"](x, positions, table, True)
    arguments, tile = fake.compiles[0]["arguments"], ar.row_tile(64, 2)
    assert arguments["tokens"] * 3 % tile == 0 and arguments["tokens"] - tile < 7 <= arguments["tokens"]
    assert arguments["conjugate"] is True and arguments["offsets"] == layout(ar.plan_buffers(tile, 64, 2))
    assert torch.equal(got, apply_rope(x, positions, table, True))


def test_the_fp4_kv_store_runs_on_the_plans_eight_row_tiles(fake):
    case = SPECS["kv_norm_rope_store"].case("v41_compressed_fp4_bf16")
    args = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    Ascend950Backend(NATIVE).implementations()["kv_norm_rope_store"](**args)
    (compile_,) = fake.compiles
    arguments = compile_["arguments"]
    assert arguments["fmt"] == "fp4" and arguments["tile_rows"] == 8 and arguments["amax_floor"] == NVFP4_AMAX_FLOOR
    assert arguments["offsets"] == layout(kv.plan_buffers(8, 512, 64, 2, "fp4"))


def test_cpu_tensors_are_refused_by_the_npu_wrappers(fake, monkeypatch):
    monkeypatch.setattr(launch, "DEVICE_TYPE", "npu")
    with pytest.raises(ValueError, match="takes npu tensors, got x on cpu"):
        Ascend950Backend(NATIVE).implementations()["rms_norm"](torch.randn(4, 64).to(BF16), torch.ones(64), 1e-6)


def test_an_npu_of_another_generation_is_refused(monkeypatch):
    npu = types.SimpleNamespace(device_count=lambda: 1, get_device_name=lambda i: "Ascend910B3")
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    with pytest.raises(RuntimeError, match="planned for A5 .* this NPU is A2"):
        Ascend950Backend(NATIVE).implementations()


def test_without_torch_npu_native_is_unavailable_and_imports_neither_stack():
    code = ("import sys\nfrom deepinfer_backends.ascend950 import Ascend950Backend\n"
            "try:\n    Ascend950Backend({'execution': 'native'}).implementations()\n"
            "except RuntimeError as error:\n    print(error)\n"
            "assert not {'torch_npu', 'tilelang'} & set(sys.modules), sorted(sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("ascend950 cannot run natively here: torch_npu does not import (")
