"""The grouped GEMM kernels side by side on one GPU, on the MoE shapes of ``bench_ops.py`` and a
few tile variants. bf16 (``study.formats=[bf16]``, the default): the portable kernel
(``kernels/grouped_gemm.py``, TileLang's automatic pipeline), the warp-specialised one with
hand-placed barriers (``kernels/grouped_gemm_ws.py``) and the Triton kernel for few rows per expert
(``fused/grouped_gemm_skinny.py``). Block-scaled (``study.formats=[fp8:mxfp4]`` and
so on, x format first): the decode-then-wgmma kernel (``kernels/grouped_gemm_quant.py``) and the
warp-specialised one whose decoder warpgroup feeds a bf16 ring (``kernels/grouped_gemm_quant_ws.py``),
the one for few rows per expert that decodes into ``mma.sync`` registers (``kernels/grouped_gemm_quant_skinny.py``),
beside the bf16 warp-specialised kernel on bf16 operands of the same shape.

Per point: each kernel's error against a float32 torch result (for block-scaled operands, of the
decoded values), its time (CUDA-graph replay, median of 5 rounds), TFLOP/s, and its ratio to
torch's dense bf16 matmul of the same total FLOPs (``rows x n x k`` in one GEMM) measured in the
same run, and the bytes it must move (``bench_points.gemm_bytes``) per second, as a share of the copy
bandwidth measured in the same run.

    python experiments/grouped_gemm_kernels.py [study.formats=[bf16,fp8:mxfp4,...]] [study.only=[LABEL_PART,...]]
        [study.kernels=[NAME_PART,...]] [+study.ws_modules.ALIAS=MODULE] [+study.skinny_modules.ALIAS=MODULE]
        [study.output_dir=DIR] [overrides...]

Prints a table and writes ``grouped_gemm_kernels_<card>.csv`` under ``experiments/results/`` or
``study.output_dir``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings, dense_rate, timed  # noqa: E402
from bench_points import _gemm_operand, gemm_bytes  # noqa: E402

HIDDEN, INTERMEDIATE, TOP = 4096, 2048, 6
POINTS = [  # (label, experts, rows, n, k): bench_ops's MoE points (384 experts, balanced EP ranks); "balanced":
    # every expert gets the same rows (whole 128-row tiles), to measure what random routing's short tiles cost
    ("EP8 T=16384 w13", 48, 16384 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=16384 w2", 48, 16384 * TOP // 8, HIDDEN, INTERMEDIATE),
    ("EP8 T=16384 w13 balanced", 48, 16384 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=16384 w2 balanced", 48, 16384 * TOP // 8, HIDDEN, INTERMEDIATE),
    ("EP8 T=4096 w13", 48, 4096 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP1 T=4096 w13", 384, 4096 * TOP, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=2048 w13", 48, 2048 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=1024 w13", 48, 1024 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=512 w13", 48, 512 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=256 w13", 48, 256 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP1 T=256 w13", 384, 256 * TOP, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=256 w2", 48, 256 * TOP // 8, HIDDEN, INTERMEDIATE),
    ("dense 8192^3", 1, 8192, 8192, 8192),
    ("small b1 w1", 16, TOP, INTERMEDIATE, HIDDEN),  # model=small's decode: 16 experts, w1 (w3) and w2 apart
    ("small b1 w2", 16, TOP, HIDDEN, INTERMEDIATE),
    ("small b16 w1", 16, 16 * TOP, INTERMEDIATE, HIDDEN),
    ("small b16 w2", 16, 16 * TOP, HIDDEN, INTERMEDIATE),
    ("small b64 w1", 16, 64 * TOP, INTERMEDIATE, HIDDEN),
    ("small b64 w2", 16, 64 * TOP, HIDDEN, INTERMEDIATE),
]
WS_VARIANTS = {  # name -> tiles of grouped_gemm_bf16_ws
    "ws 128x256 s4": {"block_m": 128, "block_n": 256, "num_stages": 4},
    "ws 128x256 s3": {"block_m": 128, "block_n": 256, "num_stages": 3},
    "ws 64x256 s4": {"block_m": 64, "block_n": 256, "num_stages": 4},
}
QUANT_WS_VARIANTS = {  # name -> tiles of grouped_gemm_quant_ws (raw stages: as many as fit; "pre": prefetch before)
    "qws 128x256 s2": {"block_m": 128, "block_n": 256, "num_stages": 2},
    "qws 128x256 s3": {"block_m": 128, "block_n": 256, "num_stages": 3},
    "qws 128x256 s3 pre": {"block_m": 128, "block_n": 256, "num_stages": 3, "prefetch": "before"},
    "qws 64x256 s2 d2 pre": {"block_m": 64, "block_n": 256, "num_stages": 2, "decoders": 2, "prefetch": "before"},
    "qws 64x256 s3 d2 pre": {"block_m": 64, "block_n": 256, "num_stages": 3, "decoders": 2, "prefetch": "before"},
    "qws 64x256 s3 d2": {"block_m": 64, "block_n": 256, "num_stages": 3, "decoders": 2},
}
SKINNY_VARIANTS = {  # name -> tiles of grouped_gemm_quant_skinny (rows a tile, m: MMA tiles a warp, chunks held
    # ahead, warps a CTA); gemm.skinny_tiles picks "t8 m2 d2" and "t16 m2 d1" / "t16 m2 d2" (fp8 / mxfp4 weights)
    "skinny t8 d2": {"block_t": 8, "warps": 4, "depth": 2},
    "skinny t8 m2 d2": {"block_t": 8, "warps": 4, "depth": 2, "tiles_m": 2},
    "skinny t8 m2 d1": {"block_t": 8, "warps": 4, "depth": 1, "tiles_m": 2},
    "skinny t8 m4 d1": {"block_t": 8, "warps": 4, "depth": 1, "tiles_m": 4},
    "skinny t16 m2 d1": {"block_t": 16, "warps": 4, "depth": 1, "tiles_m": 2},
    "skinny t16 m2 d2": {"block_t": 16, "warps": 4, "depth": 2, "tiles_m": 2},
    "skinny t32 m2 d1": {"block_t": 32, "warps": 4, "depth": 1, "tiles_m": 2},
    "skinny t8 d1": {"block_t": 8, "warps": 4, "depth": 1},
    "skinny t8 d4": {"block_t": 8, "warps": 4, "depth": 4},
    "skinny t8 w2": {"block_t": 8, "warps": 2, "depth": 2},
    "skinny t8 w8": {"block_t": 8, "warps": 8, "depth": 2},
    "skinny t16": {"block_t": 16, "warps": 4, "depth": 2},
    "skinny t16 d1": {"block_t": 16, "warps": 4, "depth": 1},
    "skinny t16 d4": {"block_t": 16, "warps": 4, "depth": 4},
    "skinny t16 w2": {"block_t": 16, "warps": 2, "depth": 2},
    "skinny t32": {"block_t": 32, "warps": 4, "depth": 2},
    "skinny t64 d1": {"block_t": 64, "warps": 4, "depth": 1},
}
BF16_BESIDE = "(bf16 operands)"  # the kernel name's tag for the bf16 kernel timed beside the block-scaled ones


@dataclass
class Settings(StudySettings):
    """Which formats, points and kernels run."""

    FAST = ("study.only=['small b1 w1']", "study.kernels=[portable,'triton skinny','ws 64x256 s4']")
    DEVICE = "cuda"

    formats: list[str] = field(default_factory=lambda: ["bf16"])
    """bf16, or X:W block-scaled pairs (fp8:fp8, fp8:mxfp4, bf16:fp8, bf16:mxfp4)."""
    only: list[str] = field(default_factory=list)
    """Keep the points whose label contains one of these (empty: every point)."""
    kernels: list[str] = field(default_factory=list)
    """Keep the kernels whose name contains one of these (empty: every kernel)."""
    ws_modules: dict[str, str] = field(default_factory=dict)
    """ALIAS -> kernels module also run as ``grouped_gemm_bf16_ws`` with each ``WS_VARIANTS`` tile
    (an earlier copy put beside the current one, timed side by side)."""
    skinny_modules: dict[str, str] = field(default_factory=dict)
    """ALIAS -> kernels module also run as ``grouped_gemm_quant_skinny`` with each ``SKINNY_VARIANTS`` tile."""


def routed(experts: int, rows: int, n: int, k: int, formats: tuple[str, str] = ("bf16", "bf16"),
           balanced: bool = False):
    """bench_ops's operands: uniformly random routing (so segments end in partial tiles; with
    ``balanced`` every expert gets ``rows / experts`` rows instead), bf16 normals or random valid
    bytes of a block-scaled format."""
    g = torch.Generator("cuda").manual_seed(0)
    sizes = torch.bincount(torch.randint(0, experts, (rows,), device="cuda", generator=g), minlength=experts)
    if balanced:
        sizes = torch.full((experts,), rows // experts, dtype=sizes.dtype, device="cuda")
    return _gemm_operand(g, (rows, k), formats[0]), _gemm_operand(g, (experts, n, k), formats[1], k ** -0.5), sizes


def _parts(operand):
    return (operand.data, operand.scale) if isinstance(operand, Quantized) else (operand, None)


def reference(x, w, sizes) -> torch.Tensor:
    """float32 result of the (decoded) operands, one matmul per segment."""
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant import decode

    xs, ws = (decode(*_parts(t), t.fmt if isinstance(t, Quantized) else "bf16").float() for t in (x, w))
    out, start = torch.empty(xs.shape[0], ws.shape[1], device=xs.device), 0
    for expert, size in enumerate(sizes.tolist()):
        out[start:start + size] = xs[start:start + size] @ ws[expert].T
        start += size
    return out


def kernels(experts: int, n: int, k: int, rows: int, formats: tuple[str, str] = ("bf16", "bf16"),
            ws_modules: dict[str, str] | None = None, skinny_modules: dict[str, str] | None = None):
    """name -> callable(x, w, sizes). bf16: the portable kernel with the wrapper's tiles, then each
    variant of the warp-specialised one (and of each ``ws_modules`` copy). Block-scaled: the
    portable block-scaled kernel with the wrapper's tiles, each variant of the warp-specialised one
    and of the one for few rows (and of each ``skinny_modules`` copy), and the bf16
    warp-specialised kernel (on bf16 operands of the same shape, made on its first call)."""
    from deepinfer_backends.sm100 import gemm
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule
    from deepinfer_backends.sm100.launch import compiled

    def launcher(module, factory, tiles, *formats_args, dtype=torch.bfloat16):
        def call(x, w, sizes):  # compiled on first use, so a filtered-out kernel costs nothing
            schedule = tile_schedule(sizes, rows, tiles.get("block_m") or tiles["block_t"])
            y = torch.empty(rows, n, dtype=dtype, device="cuda")
            if factory == "grouped_gemm_quant_skinny":
                gemm.run_quant_skinny(*_parts(x), *_parts(w), schedule, y, formats[1], tiles, module)
                return y
            if module == "grouped_gemm_quant_ws":
                gemm.run_quant_ws(*_parts(x), *_parts(w), schedule, y, formats[1], tiles)
                return y
            kernel = compiled(module, factory, experts, n, k, *formats_args, **tiles)
            if formats_args:
                (x, x_scale), (w, w_scale) = _parts(x), _parts(w)
                x_scale = torch.zeros(1, k // 32, dtype=torch.uint8, device="cuda") if x_scale is None else x_scale
                kernel(x, x_scale, w, w_scale, schedule[0], schedule[1], schedule[2], y)
            else:
                kernel(x, w, schedule[0], schedule[1], schedule[2], y)
            return y
        return call

    portable = gemm.gemm_tiles(rows, experts, n, k)
    ws_bf16 = {"block_m": portable["block_m"], "block_n": 256, "num_stages": gemm.WS_STAGES}
    if formats == ("bf16", "bf16"):
        table = {f"portable {portable['block_m']}x{portable['block_n']}":
                 launcher("grouped_gemm", "grouped_gemm_bf16", portable)}
        table["triton skinny"] = gemm.grouped_gemm_few_rows
        for name, tiles in WS_VARIANTS.items():
            table[name] = launcher("grouped_gemm_ws", "grouped_gemm_bf16_ws", tiles)
            for alias, module in (ws_modules or {}).items():
                table[f"{alias}{name[2:]}"] = launcher(module, "grouped_gemm_bf16_ws", tiles)
        return table
    quant = gemm.portable_quant_tiles(rows, experts, n, k)
    table = {f"portable q {quant['block_m']}x128": launcher("grouped_gemm_quant", "grouped_gemm_quant", quant,
                                                           *formats, dtype=torch.float32)}
    for name, tiles in QUANT_WS_VARIANTS.items():
        table[name] = launcher("grouped_gemm_quant_ws", "grouped_gemm_quant_ws", tiles, *formats, dtype=torch.float32)
    for name, tiles in SKINNY_VARIANTS.items():
        table[name] = launcher("grouped_gemm_quant_skinny", "grouped_gemm_quant_skinny", tiles, dtype=torch.float32)
        for alias, module in (skinny_modules or {}).items():
            table[f"{alias}{name[6:]}"] = launcher(module, "grouped_gemm_quant_skinny", tiles, dtype=torch.float32)
    bf16_call, bf16_operands = launcher("grouped_gemm_ws", "grouped_gemm_bf16_ws", ws_bf16), []

    def on_bf16(x, w, sizes):
        if not bf16_operands:
            bf16_operands.extend(routed(experts, rows, n, k)[:2])
        return bf16_call(*bf16_operands, sizes)
    table[f"bf16 ws {ws_bf16['block_m']}x256 {BF16_BESIDE}"] = on_bf16
    return table


def edge_check(formats: tuple[str, str], settings: Settings) -> None:
    """Every kernel on segments that are empty, shorter than a warpgroup's 64 rows, or end just past
    a tile; block-scaled operands with scale bytes over the whole range the decode branches on."""
    sizes = torch.tensor([0, 1, 63, 64, 65, 128, 129, 300, 0], device="cuda")
    g = torch.Generator("cuda").manual_seed(1)
    n, k = 512, 1024
    x, w, _ = routed(len(sizes), int(sizes.sum()), n, k, formats)
    for operand in (x, w):
        if isinstance(operand, Quantized):  # 2^-127 .. 2^13: subnormal scale, both sides of the one-multiply bound
            operand.scale.copy_(torch.randint(0, 141, operand.scale.shape, device="cuda", generator=g,
                                              dtype=torch.uint8))
    expected = reference(x, w, sizes)
    table = kernels(len(sizes), n, k, int(sizes.sum()), formats, settings.ws_modules, settings.skinny_modules)
    for name, call in table.items():
        if not wanted(name, settings.kernels) or BF16_BESIDE in name:
            continue
        err = ((call(x, w, sizes).float() - expected).abs().max() / expected.abs().max()).item()
        print(f"edge {':'.join(formats)} segments {sizes.tolist()} n={n} k={k} {name:18s} max err {err:.1e} "
              f"{'pass' if err < 1e-2 else 'FAIL'}")


def wanted(label: str, parts: list[str]) -> bool:
    """Whether ``label`` contains one of ``parts`` (every label when there are none)."""
    return not parts or any(part in label for part in parts)


def measure_point(formats: tuple[str, str], point: tuple, settings: Settings, peaks: dict[str, float]) -> list[dict]:
    """One row per kernel of ``settings.kernels`` that runs at ``point`` (``(label, experts, rows,
    n, k)`` of :data:`POINTS`); a kernel that fails is printed and left out."""
    label, experts, rows, n, k = point
    x, w, sizes = routed(experts, rows, n, k, formats, balanced="balanced" in label)
    expected = reference(x, w, sizes)
    same = dense_rate(rows, n, k)
    flops = 2.0 * rows * n * k
    moved = gemm_bytes(experts, rows, n, k, *formats)
    out = []
    for name, call in kernels(experts, n, k, rows, formats, settings.ws_modules, settings.skinny_modules).items():
        if not wanted(name, settings.kernels):
            continue
        try:
            err = float("nan") if BF16_BESIDE in name else \
                ((call(x, w, sizes).float() - expected).abs().max() / expected.abs().max()).item()
            seconds, _ = timed(lambda: call(x, w, sizes), reps=5)
        except Exception as error:  # a variant that does not fit (shared memory) is reported, not fatal
            print(f"{label:18s} {name:18s} error: {type(error).__name__}: {str(error)[:120]}")
            continue
        row = {"formats": ":".join(formats), "shape": f"{label} E={experts} M={rows} N={n} K={k}", "kernel": name,
               "max_err": err, "time_us": seconds * 1e6, "tflop_s": flops / seconds / 1e12,
               "frac_dense_same_flops": flops / seconds / same,
               "frac_dense_8192": flops / seconds / peaks["dense_bf16"], "gb_s": moved / seconds / 1e9,
               "frac_copy": moved / seconds / peaks["copy_bw"]}
        out.append(row)
        print(f"{':'.join(formats):11s} {label:18s} {name:18s} err {err:.1e} {row['time_us']:9.1f} us "
              f"{row['tflop_s']:6.1f} TF/s same-FLOPs dense {same / 1e12:4.0f}: "
              f"{row['frac_dense_same_flops']:.2f}  8192^3: {row['frac_dense_8192']:.2f}  "
              f"{row['gb_s']:6.0f} GB/s copy: {row['frac_copy']:.2f}", flush=True)
    return out


def main(argv=None) -> int:
    _, settings = compose_study("grouped_gemm_kernels", Settings, argv)
    card = torch.cuda.get_device_name().replace(" ", "_")
    peaks = ceilings()
    print(f"{card}: dense bf16 8192^3 {peaks['dense_bf16'] / 1e12:.0f} TFLOP/s, copy {peaks['copy_bw'] / 1e9:.0f} GB/s")
    rows = []
    for formats in (tuple((f.split(":") * 2)[:2]) for f in settings.formats):
        edge_check(formats, settings)
        rows += [row for point in POINTS if wanted(point[0], settings.only)
                 for row in measure_point(formats, point, settings, peaks)]
    path = write_results(settings.results_path(f"grouped_gemm_kernels_{card.split('_')[-1].lower()}"), rows,
                         study_command("grouped_gemm_kernels", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
