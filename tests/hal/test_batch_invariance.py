"""The reference backend's batch-invariant op table: every op classified, each row's bits
independent of the batch around it, prefill and decode attention on one numeric path, results
within tolerance of the reference, and the op table's refusals."""
import pytest
import torch

from deepinfer.hal import SPECS, Backend, BatchInvarianceError, Capabilities, OpTable, get_backend
from deepinfer.hal import register_backend, unregister_backend
from deepinfer.hal.formats import Quantized, decode_tokens
from deepinfer.hal.spec import compare
from deepinfer_backends.reference.batch_invariant import CUSTOM, INVARIANT_AS_IS, ROW_TILE, ROW_TILED
from tests.hal.oracle import _clone

INVARIANT = get_backend("reference").implementations(batch_invariant=True)
ROW_ARGS = {**ROW_TILED, "mla_sparse_prefill": ("q", "indices"), "mla_sparse_decode": ("q", "indices", "extra_indices"),
            "indexer_logits": ("q", "weights")}
TILED = sorted(op for op in SPECS if op not in INVARIANT_AS_IS)


def _inputs(op: str, case: str) -> dict:
    return SPECS[op].case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))


def _rows(value, index: torch.Tensor):
    if isinstance(value, Quantized):
        return Quantized(value.data[index], value.scale[index], value.fmt, value.block)
    return value[index]


def _row_count(value) -> int:
    return (value.data if isinstance(value, Quantized) else value).shape[0]


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def test_every_op_is_classified_once_with_its_row_arguments():
    for op, spec in SPECS.items():
        homes = [name for name, table in (("ROW_TILED", ROW_TILED), ("CUSTOM", CUSTOM),
                                          ("INVARIANT_AS_IS", INVARIANT_AS_IS)) if op in table]
        assert len(homes) == 1, f"op {op!r} must be in exactly one of ROW_TILED, CUSTOM, INVARIANT_AS_IS; is in {homes}"
        params = spec.reference.__code__.co_varnames[:spec.reference.__code__.co_argcount]
        assert set(ROW_ARGS.get(op, ())) <= set(params), f"{op}: row arguments {ROW_ARGS[op]} not in {params}"
    assert set(INVARIANT) == set(SPECS)


@pytest.mark.parametrize("op,case", [(op, c.name) for op in TILED for c in SPECS[op].cases if c.size == "tiny"])
def test_batch_invariant_ops_match_the_reference(op, case):
    spec, inputs = SPECS[op], _inputs(op, case)
    failures = compare(INVARIANT[op](**_clone(inputs)), spec.reference(**_clone(inputs)),
                       spec.case_tolerance(spec.case(case)), f"batch_invariant/{op}/{case}")
    assert not failures, "\n".join(failures)


PER_SEQUENCE_KEYS = ("tiny_per_sequence", "tiny_per_sequence_bf16", "tiny_scaled_bf16")
"""indexer_logits cases whose keys are one list per sequence: their rows pair with their sequence's keys."""


@pytest.mark.parametrize("op,case", [(op, c.name) for op in sorted(ROW_ARGS) if op in SPECS
                                     for c in SPECS[op].cases if c.size == "tiny" and c.name not in PER_SEQUENCE_KEYS])
def test_each_row_has_the_same_bits_alone_and_anywhere_in_a_larger_batch(op, case):
    """Shuffled copies of every row, filling more than one tile, against each row computed alone."""
    inputs = _inputs(op, case)
    rows = [name for name in ROW_ARGS[op] if inputs.get(name) is not None]
    count = _row_count(inputs[rows[0]])
    if not count:
        pytest.skip("the case has no rows to place in a batch")
    copies = ROW_TILE // count + 2
    order = torch.randperm(copies * count, generator=torch.Generator().manual_seed(1)) % count
    batched = _outputs(INVARIANT[op](**{**_clone(inputs), **{n: _rows(inputs[n], order) for n in rows}}))
    for i in range(count):
        alone = _outputs(INVARIANT[op](**{**_clone(inputs), **{n: _rows(inputs[n], torch.tensor([i])) for n in rows}}))
        for where in (order == i).nonzero()[:, 0].tolist():
            for got, want in zip(batched, alone):
                assert torch.equal(got[where], want[0]), f"{op}/{case}: row {i} differs at batch position {where}"


@pytest.mark.parametrize("case", ["tiny", "tiny_bf16", "tiny_fp8_fp8", "tiny_fp8_mxfp4", "empty_experts"])
def test_grouped_gemm_row_does_not_depend_on_its_segment(case):
    inputs = _inputs("grouped_gemm", case)
    x, weight, sizes = inputs["x"], inputs["weight"], inputs["group_sizes"]
    expert_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    grown = torch.cat([(expert_of == e).nonzero()[:, 0].repeat(9)[torch.randperm(9 * int(n))]
                       for e, n in enumerate(sizes.tolist())])
    batched = INVARIANT["grouped_gemm"](_rows(x, grown), weight, 9 * sizes)
    for where, row in enumerate(grown.tolist()):
        alone_sizes = torch.nn.functional.one_hot(expert_of[row], sizes.numel())
        alone = INVARIANT["grouped_gemm"](_rows(x, torch.tensor([row])), weight, alone_sizes)
        assert torch.equal(batched[where], alone[0]), f"{case}: row {row} differs at position {where}"


def test_indexer_logits_of_a_key_do_not_depend_on_the_other_keys():
    inputs = _inputs("indexer_logits", "tiny_two_blocks")
    k = inputs["k"]
    others = torch.randn(300, k.shape[1], generator=torch.Generator().manual_seed(2))
    wide = INVARIANT["indexer_logits"](inputs["q"], torch.cat((others[:131], k, others[131:])), inputs["weights"])
    assert torch.equal(wide[:, 131:131 + k.shape[0]], INVARIANT["indexer_logits"](**inputs))


@pytest.mark.parametrize("case", PER_SEQUENCE_KEYS)
def test_per_sequence_indexer_logits_have_the_bits_of_the_shared_key_path(case):
    """A decode step scores each sequence's own keys ([B, S, d]); prefill scores a flat key buffer.
    Each sequence's logits must be those of its queries against its keys alone, whatever the
    other sequences hold and wherever its keys sit in a flat buffer."""
    inputs = _inputs("indexer_logits", case)
    q, k, weights = inputs["q"], inputs["k"], inputs["weights"]
    per_seq = q.shape[0] // k.shape[0]
    batched = INVARIANT["indexer_logits"](**inputs)
    others = torch.randn(70, k.shape[2], generator=torch.Generator().manual_seed(3)).to(k.dtype)
    for b in range(k.shape[0]):
        rows = slice(b * per_seq, (b + 1) * per_seq)
        flat = INVARIANT["indexer_logits"](q[rows], torch.cat((others, k[b])), weights[rows],
                                           weight_scale=inputs.get("weight_scale", 1.0))
        assert torch.equal(batched[rows], flat[:, others.shape[0]:]), f"{case}: sequence {b}"


@pytest.mark.parametrize("case", ["tiny_bf16_cache", "tiny_fp8_fp4", "tiny_duplicates", "tiny_empty_rows"])
def test_a_token_gets_the_same_bits_through_prefill_and_decode_attention(case):
    """Decode reads the paged caches; prefill reads the same decoded keys from a gathered buffer."""
    args = _inputs("mla_sparse_decode", case)
    q, batch, s_q = args["q"], args["q"].shape[0], args["q"].shape[1]
    main = decode_tokens(args["cache"].reshape(-1, args["cache"].shape[-1]), args["cache_format"])
    kv, indices = main, args["indices"].reshape(batch * s_q, -1)
    if args.get("extra_cache") is not None:
        extra = decode_tokens(args["extra_cache"].reshape(-1, args["extra_cache"].shape[-1]), args["extra_format"])
        shifted = args["extra_indices"].reshape(batch * s_q, -1)
        shifted = torch.where(shifted >= 0, shifted + main.shape[0], shifted)
        kv, indices = torch.cat((main, extra)), torch.cat((indices, shifted), dim=1)
    out, lse = INVARIANT["mla_sparse_decode"](**args)
    prefill_out, prefill_lse = INVARIANT["mla_sparse_prefill"](q.reshape(batch * s_q, *q.shape[2:]), kv, indices,
                                                               args["sink"], args["scale"])
    assert torch.equal(prefill_out, out.reshape(prefill_out.shape))
    assert torch.equal(prefill_lse, lse.reshape(prefill_lse.shape))


class PlainBackend(Backend):
    """Declares no batch invariance; serves rms_norm only."""

    name = "plain"
    capabilities = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))

    def implementations(self):
        return {"rms_norm": SPECS["rms_norm"].reference}


@pytest.fixture
def plain():
    register_backend(PlainBackend)
    yield
    unregister_backend("plain")


def test_batch_invariant_table_takes_the_invariant_versions():
    table = OpTable("reference", batch_invariant=True)
    assert table.batch_invariant and set(table.sources.values()) == {"reference"}
    assert table.linear.__wrapped__ is SPECS["linear"].reference and table.grouped_gemm is CUSTOM["grouped_gemm"]
    assert table.apply_rope is SPECS["apply_rope"].reference
    assert OpTable("reference").linear is SPECS["linear"].reference


def test_backend_without_the_capability_is_refused_naming_it(plain):
    with pytest.raises(BatchInvarianceError, match=r"backend 'plain' .*does not declare batch invariance"):
        OpTable("plain", batch_invariant=True)
    with pytest.raises(BatchInvarianceError, match=r"backend 'plain' \(asked for op 'rms_norm'\)"):
        OpTable("reference", overrides={"rms_norm": "plain"}, batch_invariant=True)
    mixed = OpTable("reference", overrides={"rms_norm": "plain"})
    assert mixed.sources["rms_norm"] == "plain"


def test_invariant_backend_must_accept_the_switch():
    caps = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), batch_invariant=True)
    with pytest.raises(TypeError, match="implementations\\(\\) must take a `batch_invariant"):
        type("Claims", (Backend,), {"name": "claims", "capabilities": caps, "implementations": lambda self: {}})
