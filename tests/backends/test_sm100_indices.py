"""The sm100 Triton kernels of the SWA index ops, ``compressed_decode_layout``, ``compress_tokens``
and ``apply_token_bitmask``: every OpSpec case but the real-size ones (on a GPU, all of them) and
edge cases (padding rows, negative positions, visible starts, windows past the positions, ratio-4
groups split across calls, mask row subsets, vocabularies not a multiple of 32) against the
reference, run by Triton's interpreter on the CPU in a subprocess (integers and masked logits
exact, in-place state and logits compared too); and every kernel compiled for sm_90. On a GPU:
``python -c "from tests.backends.test_sm100_indices import run_checks; run_checks('cuda', 'swa',
'compress', 'bitmask')"``."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from tests.backends.triton_cubin import hopper_cubin
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

FAMILIES = {"swa": ("swa_ring_slots", "swa_decode_indices", "swa_prefill_indices", "swa_history_slots"),
            "compress": ("compress_tokens",), "bitmask": ("apply_token_bitmask",),
            "compressed_layout": ("compressed_decode_layout",)}
IN_PLACE = {"compress_tokens": "state", "apply_token_bitmask": "logits"}
"""The argument each op writes in place, compared after the call."""
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _vectors(**values):
    return {name: torch.tensor(v, dtype=torch.int64) if isinstance(v, list) else v for name, v in values.items()}


def _swa_edges():
    """(op, name, calls) for the SWA index ops' edges; a case is one call."""
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(-300, 400, (1000,), generator=gen)
    slots = torch.randint(-1, 50, (1000,), generator=gen)
    visible = positions - torch.randint(-5, 300, (1000,), generator=gen)
    starts = positions - torch.randint(0, 40, (1000,), generator=gen)
    yield "swa_ring_slots", "padding_negative_positions", [_vectors(
        state_slots=[-1, 0, 3, 3, -1, 2], positions=[5, -1, -7, 13, -13, 0], ring_size=6)]
    yield "swa_ring_slots", "ring_of_one_many_rows", [dict(state_slots=slots, positions=positions, ring_size=1)]
    yield "swa_ring_slots", "empty", [_vectors(state_slots=[], positions=[], ring_size=4)]
    yield "swa_decode_indices", "window_past_positions_padding", [_vectors(
        state_slots=[-1, 0, 1, 2, 2], positions=[3, 0, 2, -1, -9], window=6, ring_size=6)]
    yield "swa_decode_indices", "visible_start_edges", [_vectors(
        state_slots=[0, 0, 0, 0, 1, -1], positions=[9, 9, 9, 2, 5, 5], visible_start=[-4, 0, 8, 10, 6, 3],
        window=4, ring_size=7)]
    yield "swa_decode_indices", "window_one", [_vectors(state_slots=[0, 1, -1], positions=[0, 7, 4], window=1,
                                                        ring_size=3)]
    yield "swa_decode_indices", "wide_window_many_rows", [dict(state_slots=slots, positions=positions, window=300,
                                                               ring_size=307, visible_start=visible)]
    yield "swa_decode_indices", "empty", [_vectors(state_slots=[], positions=[], window=4, ring_size=5)]
    yield "swa_prefill_indices", "window_past_positions", [_vectors(
        positions=[0, 1, 2, 5, 6], chunk_start=[0, 0, 0, 5, 5], history_offset=[0, 0, 0, 9, 9],
        chunk_offset=[18, 18, 18, 21, 21], window=10)]
    yield "swa_prefill_indices", "visible_start_edges", [_vectors(
        positions=[4, 5, 6, 7], chunk_start=[4, 4, 4, 4], history_offset=[0, 0, 0, 0], chunk_offset=[3, 3, 3, 3],
        visible_start=[-2, 5, 7, 9], window=4)]
    yield "swa_prefill_indices", "wide_window_many_rows", [dict(
        positions=positions, chunk_start=starts, history_offset=torch.arange(1000) * 299,
        chunk_offset=torch.arange(1000) * 40 + 300_000, window=300, visible_start=visible)]
    yield "swa_prefill_indices", "empty", [_vectors(positions=[], chunk_start=[], history_offset=[], chunk_offset=[],
                                                    window=3)]
    yield "swa_history_slots", "window_one", [_vectors(state_slots=[0, 1], chunk_start=[0, 5], window=1,
                                                       ring_size=2)]
    yield "swa_history_slots", "padding_chunk_start_zero", [_vectors(
        state_slots=[-1, 0, 2, 1], chunk_start=[7, 0, 2, 9], window=5, ring_size=8)]
    yield "swa_history_slots", "wide_window", [dict(state_slots=slots[:200], chunk_start=positions[:200].abs(),
                                                    window=300, ring_size=300)]


def _compress_call(sequences, dim, ratio, state, gen):
    """One call: ``sequences`` of (slot, first position, token count), ``state`` shared."""
    positions = torch.cat([torch.arange(first, first + count) for _, first, count in sequences])
    slots = torch.cat([torch.full((count,), slot) for slot, _, count in sequences])
    starts = torch.cat([torch.full((count,), first) for _, first, count in sequences])
    score = None if ratio == 1 else 3 * torch.randn(positions.numel(), dim, generator=gen)
    return dict(latent=torch.randn(positions.numel(), dim, generator=gen), score=score, positions=positions,
                state_slots=slots, chunk_start=starts, state=state, ratio=ratio)


def _compress_edges():
    """(op, name, calls) for ``compress_tokens``; the calls of a case share its state."""
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(3, 6, 2, 32, generator=gen)
    yield "compress_tokens", "ratio4_split_across_calls", [
        _compress_call([(1, 0, 6), (0, 0, 3)], 32, 4, state, gen),
        _compress_call([(1, 6, 1), (0, 3, 5)], 32, 4, state, gen),
        _compress_call([(0, 8, 9), (1, 7, 1)], 32, 4, state, gen),
        _compress_call([(1, 8, 1), (0, 17, 1), (2, 0, 2)], 32, 4, state, gen)]
    yield "compress_tokens", "ring_of_ratio_long_chunks", [
        _compress_call([(0, 1, 11), (1, 4, 9)], 24, 2, torch.randn(2, 2, 2, 24, generator=gen), gen)]
    yield "compress_tokens", "ratio3_wide_rows", [
        _compress_call([(2, 4, 7), (0, 0, 2)], 700, 3, torch.randn(3, 5, 2, 700, generator=gen), gen)]
    yield "compress_tokens", "one_channel", [_compress_call([(0, 2, 5)], 1, 2, torch.randn(1, 3, 2, 1, generator=gen),
                                                            gen)]
    yield "compress_tokens", "ratio1_wide", [_compress_call([(0, 0, 3)], 1100, 1, None, gen)]
    yield "compress_tokens", "empty", [_compress_call([(0, 0, 0)], 16, 2, torch.randn(1, 2, 2, 16, generator=gen),
                                                      gen)]


def _bitmask_edges():
    """(op, name, calls) for ``apply_token_bitmask``."""
    from deepinfer.hal.ops.token_bitmask import bitmask_words, random_bitmask

    gen = torch.Generator().manual_seed(3)
    for vocab, rows, masked in ((1, 3, None), (33, 4, [2, 0]), (129285, 3, [2, 0]), (97, 5, [])):
        logits = torch.randn(rows, vocab, generator=gen)
        logits[:, ::5] = -0.0
        count = rows if masked is None else len(masked)
        mask = random_bitmask(count, vocab, (0.5, 0.0, 1.0), gen) if count else \
            torch.zeros(0, bitmask_words(vocab), dtype=torch.int32)
        call = dict(logits=logits, bitmask=mask)
        if masked is not None:
            call["rows"] = torch.tensor(masked, dtype=torch.int64)
        yield "apply_token_bitmask", f"vocab{vocab}_rows{rows}_{'all' if masked is None else len(masked)}", [call]
    words = bitmask_words(77)
    yield "apply_token_bitmask", "strided_logits", [dict(
        logits=torch.randn(6, 90, generator=gen)[:, 3:80], bitmask=random_bitmask(3, 77, 0.5, gen)[:, :words],
        rows=torch.tensor([4, 1, 5]))]


def _layout_edges():
    """(op, name, calls) for ``compressed_decode_layout``: an empty table width, padding rows,
    negative positions, a sequence that fills its table, ratio 4, a strided block table."""
    yield "compressed_decode_layout", "empty_width", [dict(
        block_tables=torch.zeros(2, 0, dtype=torch.int64), **_vectors(context_lens=[0, 0], positions=[-1, -1],
                                                                       seq_of_token=[0, 1]), ratio=2,
        tokens_per_block=4)]
    yield "compressed_decode_layout", "full_tables_ratio4", [dict(
        block_tables=torch.tensor([[5, 2], [0, 7]]), **_vectors(context_lens=[32, 31], positions=[31, 28, 29, 30],
                                                                 seq_of_token=[0, 1, 1, 1]), ratio=4,
        tokens_per_block=4)]
    yield "compressed_decode_layout", "padding_rows_ratio1", [dict(
        block_tables=torch.tensor([[3, 6, -1], [-1, -1, -1], [1, 4, 0]]),
        **_vectors(context_lens=[5, 0, 9], positions=[4, -1, 8], seq_of_token=[0, 1, 2]), ratio=1,
        tokens_per_block=4)]
    tables = torch.arange(60).view(5, 12)[:, ::2]
    yield "compressed_decode_layout", "strided_tables", [dict(
        block_tables=tables, **_vectors(context_lens=[40, 3, 17, 0, 48], positions=[39, 2, 16, -1, 47],
                                        seq_of_token=[0, 1, 2, 3, 4]), ratio=2, tokens_per_block=4)]
    yield "compressed_decode_layout", "no_tokens", [dict(
        block_tables=torch.tensor([[1]]), **_vectors(context_lens=[3], positions=[], seq_of_token=[]), ratio=2,
        tokens_per_block=2)]


def cases(family: str, real: bool = True):
    """(op, case name, calls): every OpSpec case of the family's ops (but the ``real``-size ones
    without ``real``), then its edge cases."""
    importlib.import_module("deepinfer.hal.ops")  # declares every OpSpec
    from deepinfer.hal.spec import SPECS

    for op in FAMILIES[family]:
        for case in SPECS[op].cases:
            if case.size == "real" and not real:
                continue
            yield op, case.name, [case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))]
    yield from {"swa": _swa_edges, "compress": _compress_edges, "bitmask": _bitmask_edges,
                "compressed_layout": _layout_edges}[family]()


def _copied(call: dict, device: torch.device, carried: torch.Tensor | None, op: str) -> dict:
    """``call`` on ``device``, each tensor a copy with the same strides."""
    copy = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).copy_(v)
            if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    if carried is not None:
        copy[IN_PLACE[op]] = carried
    return copy


def _wrapper(op: str):
    from deepinfer_backends.sm100 import compress, compressed_layout, swa_indices, token_bitmask

    return getattr({"compress_tokens": compress, "apply_token_bitmask": token_bitmask,
                    "compressed_decode_layout": compressed_layout}.get(op, swa_indices), op)


def run_checks(device: str, *families: str, real: bool = True) -> None:
    """Each case of ``families`` (:func:`cases`) on ``device`` against the reference on the CPU
    (calls of a case carry their in-place tensor); prints ``op case ok`` per case, raises on a
    mismatch."""
    importlib.import_module("deepinfer.hal.ops")  # declares every OpSpec
    from deepinfer.hal.spec import SPECS, compare

    for family in families:
        for op, name, calls in cases(family, real):
            spec, got_carry, want_carry = SPECS[op], None, None
            for call in calls:
                got_args = _copied(call, torch.device(device), got_carry, op)
                want_args = _copied(call, torch.device("cpu"), want_carry, op)
                got, want = _wrapper(op)(**got_args), spec.reference(**want_args)
                pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
                if op in IN_PLACE and want_args[IN_PLACE[op]] is not None:
                    got_carry, want_carry = got_args[IN_PLACE[op]], want_args[IN_PLACE[op]]
                    pairs.append((got_carry, want_carry))
                for got_value, want_value in pairs:
                    assert got_value.dtype == want_value.dtype, (op, name, got_value.dtype, want_value.dtype)
                    failures = compare(got_value, want_value, spec.tolerance(torch.float32), f"{op}/{name}")
                    assert not failures, failures
                if op == "apply_token_bitmask":
                    assert got is got_args["logits"], "apply_token_bitmask returns its logits"
                    _check_masked_bits(call, got)
            print(op, name, "ok", flush=True)
    if "compress" in families:
        _check_compress_padding_and_value_checks(torch.device(device))


def _check_masked_bits(call: dict, got: torch.Tensor) -> None:
    """Disallowed logits are -inf and allowed ones keep their bits (-0.0 included)."""
    from deepinfer.hal.ops.token_bitmask import _masked_fill

    want, bitmask = call["logits"].clone(), call["bitmask"]
    full = torch.full((want.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[call.get("rows", torch.arange(bitmask.shape[0]))] = bitmask
    _masked_fill(want, full)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), "masked logits differ in their bits"


def _check_compress_padding_and_value_checks(device: torch.device) -> None:
    """Padding rows (slot -1) with value checks off leave the state alone and do not change the
    other rows; broken groups raise the reference's error only with value checks on."""
    from deepinfer.hal.ops.compress import compress_tokens as reference
    from deepinfer.hal.value_checks import skip_value_checks
    from deepinfer_backends.sm100.compress import compress_tokens

    gen = torch.Generator().manual_seed(4)
    state = torch.randn(2, 4, 2, 16, generator=gen)
    call = _compress_call([(1, 2, 5), (0, 5, 3), (1, 0, 2)], 16, 2, state, gen)
    call["state_slots"][-2:] = -1
    real = {k: v[:8] if isinstance(v, torch.Tensor) and k != "state" else v for k, v in call.items()}
    want_state = state.clone()
    want_out, want_emit = reference(**{**real, "state": want_state})
    got_args = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    with skip_value_checks():
        got_out, got_emit = compress_tokens(**got_args)
    assert torch.equal(got_emit[:8].cpu(), want_emit)
    assert torch.allclose(got_out[:8].cpu().float(), want_out.float(), atol=1e-5, rtol=2**-7)  # bf16 rows
    assert torch.equal(got_args["state"].cpu(), want_state), "padding rows wrote the state"
    print("compress_tokens padding_rows_value_checks_off ok")
    broken = _compress_call([(0, 0, 4)], 8, 2, torch.randn(1, 3, 2, 8, generator=gen), gen)
    broken["positions"] = torch.tensor([0, 1, 3, 2])
    errors = []
    for impl in (reference, compress_tokens):
        with pytest.raises(ValueError) as error:
            impl(**{k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in broken.items()})
        errors.append(str(error.value))
    assert errors[0] == errors[1], errors
    with skip_value_checks():
        compress_tokens(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in broken.items()})
    print("compress_tokens value_checks_only_when_on ok")


EXTRA = {"compress": ["compress_tokens padding_rows_value_checks_off ok", "compress_tokens value_checks_only_when_on ok"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernels_match_the_reference_in_the_interpreter(family):
    """Every case but the real-size ones (minutes in the interpreter; ``run_checks`` on a GPU runs them)."""
    done = subprocess.run([sys.executable, "-c", "import sys; from tests.backends.test_sm100_indices import "
                           "run_checks; run_checks('cpu', sys.argv[1], real=False)", family], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [f"{op} {name} ok" for op, name, _ in cases(family, real=False)] + EXTRA.get(family, [])
    assert done.stdout.splitlines() == expected


def _kernels():
    from deepinfer_backends.sm100.fused import compress, compressed_layout, swa_indices, token_bitmask
    from deepinfer_backends.sm100.swa_indices import _tiles

    yield "compressed_layout_kernel", compressed_layout.compressed_layout_kernel, dict(
        block_tables="*i64", context_lens="*i64", positions="*i64", seq_of_token="*i64", rows="*i32",
        visible="*i64", store_rows="*i64", key_positions="*i64", batch="i32", tokens="i32", width="i32",
        table_stride="i32", ratio="i32", tokens_per_block="i32"), dict(BLOCK=compressed_layout.BLOCK)

    ring = dict(state_slots="*i64", anchors="*i64", visible_start="*i64", n="i32", count="i32", first_offset="i32",
                ring_size="i32")
    for name, out, visible, keys in (("ring_slots", "*i64", False, 1), ("decode", "*i32", True, 128),
                                     ("history", "*i64", False, 127)):
        yield f"ring_window_kernel[{name}]", swa_indices.ring_window_kernel, {**ring, "out": out}, \
            dict(HAS_VISIBLE=visible, **_tiles(64, keys)[1])
    yield "prefill_window_kernel", swa_indices.prefill_window_kernel, dict(
        positions="*i64", chunk_start="*i64", history_offset="*i64", chunk_offset="*i64", visible_start="*i64",
        out="*i32", n="i32", window="i32"), dict(HAS_VISIBLE=True, **_tiles(4096, 128)[1])
    pool = dict(latent="*fp32", score="*fp32", state="*fp32", positions="*i64", state_slots="*i64",
                chunk_start="*i64", out="*fp32", emit="*i8", dim="i32", num_slots="i32", ring_length="i32")
    for ratio in (1, 2, 4):
        yield f"compress_pool_kernel[ratio{ratio}]", compress.compress_pool_kernel, pool, \
            dict(RATIO=ratio, BLOCK=compress.BLOCK_CHANNELS)
    yield "compress_store_kernel", compress.compress_store_kernel, dict(
        latent="*fp32", score="*fp32", state="*fp32", positions="*i64", state_slots="*i64", tokens="i32", dim="i32",
        num_slots="i32", ring_length="i32"), dict(BLOCK=compress.BLOCK_CHANNELS)
    for has_rows in (False, True):
        yield f"token_bitmask_kernel[rows={has_rows}]", token_bitmask.token_bitmask_kernel, dict(
            logits="*fp32", bitmask="*i32", rows="*i64", vocab="i32", words="i32", row_stride="i32",
            column_stride="i32"), dict(HAS_ROWS=has_rows, BLOCK_WORDS=token_bitmask.BLOCK_WORDS)


KERNELS = list(_kernels()) if importlib.util.find_spec("triton") else []


@pytest.mark.parametrize("name,kernel,signature,constants", KERNELS, ids=[k[0] for k in KERNELS])
def test_triton_kernel_compiles_for_hopper(name, kernel, signature, constants):
    assert hopper_cubin(kernel, signature, constants), f"{name}: no cubin"
