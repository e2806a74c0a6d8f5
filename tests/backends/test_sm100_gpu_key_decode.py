"""The sm100 key-row decoders (``kernels/key_decode.py``) on a GPU: every byte of fp8 and fp4 cache
rows, with scales over their whole range, decodes to the same bf16 bits as the reference decode
(``deepinfer.hal.formats.decode_tokens``) rounded to bf16. Skipped without a GPU or tilelang."""
import importlib.util

import pytest
import torch

from deepinfer.hal.formats import decode_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                                  reason="the sm100 backend needs tilelang")]


def _rows(fmt: str, count: int) -> torch.Tensor:
    """Random value bytes (every code, both signs) and scale bytes over the format's range."""
    g = torch.Generator().manual_seed(1)
    data_bytes = 512 if fmt == "fp8" else 256
    rows = torch.randint(0, 256, (count, data_bytes + (16 if fmt == "fp8" else 32)), generator=g, dtype=torch.uint8)
    if fmt == "fp8":
        rows[:, :data_bytes] = torch.where((rows[:, :data_bytes] & 0x7F) == 0x7F, 0, rows[:, :data_bytes])  # no NaN
        rows[:, data_bytes:] = torch.randint(0, 255, (count, 16), generator=g, dtype=torch.uint8)  # UE8M0 0..254
        rows[0, data_bytes:] = torch.tensor([0, 1, 2, 100, 119, 120, 127, 134, 135, 160, 200, 240, 250, 252, 253, 254])
    else:
        scales = rows[:, data_bytes:]
        rows[:, data_bytes:] = torch.where((scales & 0x7F) == 0x7F, 0x7E, scales)  # e4m3 scales, no NaN
        rows[0, data_bytes:data_bytes + 16] = torch.arange(16, dtype=torch.uint8)  # subnormal scales
    return rows


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_decoded_rows_match_the_reference_bit_for_bit(fmt):
    from deepinfer_backends.sm100.kernels.key_decode import decode_rows

    rows = _rows(fmt, 4096)
    out = torch.empty(rows.shape[0], 512, dtype=torch.bfloat16, device="cuda")
    decode_rows(fmt)(rows.cuda(), out)
    expected = decode_tokens(rows, fmt).bfloat16()
    assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16)), \
        f"{(out.cpu() != expected).sum().item()} values differ"
