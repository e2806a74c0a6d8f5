"""Lower each ascend950 tilelang-ascend kernel to ``pto`` for ``A5`` and check it against the
emulation's plan: the launch's block count (one block an AI core), the tile rounds each core
runs, every planned on-chip buffer's byte offset and size (32-byte rounded) and tile shape, and,
for the row kernels, how a tile's GM offset follows the core and round indices; and that no
scalar declaration landed inside a call's arguments (source that cannot compile). Buffers the
lowering folds into another's storage are listed as ``merged``; the scratch the lowering sizes
and places itself (the row reductions', the gathers') need only lie in the plan's reservation. The lowering runs in
``study.python`` (an interpreter with tilelang-ascend; on x86 an aarch64 CPython under
qemu-user-static made by ``experiments/ascend_lower_setup.sh``); the fast mode only states the
plan's expectations, starting no interpreter. Results: ``experiments/results/ascend_lower*.csv``."""
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ascend_lower_kernels as lowering  # noqa: E402
from deepinfer.config.schema import ConfigError  # noqa: E402
from deepinfer.results import write_results  # noqa: E402
from deepinfer.study import StudySettings, compose_study, study_command  # noqa: E402

ALIGN = 32
DECLARATION_IN_CALL = re.compile(r"\(\w+, +(?:int|float|uint|bool)\w* \w+(?: = |;)")
"""A scalar declaration lowered inside a call's arguments (a reinterpret, ``f(c, int32_t v_ = ...;``,
or a conditional expression, ``f(c, float condval; if ...``): source that cannot compile."""
COMPILER_SCRATCH = ("reduce_scratch", "gather_scratch")
"""Planned buffers the lowering allocates itself (after the annotated ones): their size is its choice."""


@dataclass
class Settings(StudySettings):
    """Which interpreter lowers, and for which target and platform."""

    FAST = ("study.lower=false",)

    python: Optional[str] = None
    """Command of an interpreter with tilelang-ascend; None: ``$ASCEND_ENV/python`` (the folder
    ``experiments/ascend_lower_setup.sh`` fills)."""
    lower: bool = True
    """Lower the kernels (false: only the plan's expectations)."""
    target: str = "pto"
    platform: str = "A5"


def cases(target: str = "pto", platform: str = "A5") -> list[dict]:
    """Each kernel's lowering job with what its plan expects: ``blocks``, ``rounds``, the
    planned buffers (``plan``), ``names`` (plan name to lowered name where they differ),
    ``aliases`` (a lowered buffer placed in a planned one's storage, or ``(planned, bytes)`` that
    far into it), ``shapes`` (rows, columns)
    of lowered tiles by lowered name and ``gm_strides`` (the GM offset's coefficient of each loop
    index, for the row kernels)."""
    import torch

    from deepinfer.hal.formats import FP8_AMAX_FLOOR, MXFP4_AMAX_FLOOR, NVFP4_AMAX_FLOOR
    from deepinfer_backends.ascend950.buffers import AI_CORES, layout
    from deepinfer_backends.ascend950.emulate import apply_rope as ar
    from deepinfer_backends.ascend950.emulate import grouped_gemm as gg
    from deepinfer_backends.ascend950.emulate import kv_norm_rope_store as kv
    from deepinfer_backends.ascend950.emulate import mla
    from deepinfer_backends.ascend950.emulate import rms_norm as rn

    cores = AI_CORES[platform]
    found = []
    for dim in (1024, 7168):
        rows = rn.row_tile(dim, 2, platform)
        plan = rn.plan_buffers(rows, dim, 2)
        vector_cores = 2 * cores
        tiles = 2 * vector_cores
        found.append(dict(
            name=f"rms_norm_bf16_d{dim}", module="rms_norm", builder="rms_norm_kernel",
            kwargs=dict(rows=tiles * rows, dim=dim, tile_rows=rows, vector_cores=vector_cores, eps=1e-6,
                        offsets=layout(plan, platform)),
            blocks=cores, rounds=-(-tiles // vector_cores), plan=plan,
            names={"residual": "residual_ub", "weight": "weight_ub", "reduce_scratch": "tmp_ub"},
            shapes={"rows_in": (2 * rows, dim), "residual_ub": (2 * rows, dim), "work": (rows, dim),
                    "weight_ub": (1, dim)},
            gm_strides={"step": vector_cores * rows * dim, "block": 2 * rows * dim, "sub": rows * dim}))
    for key, dtype, out_bytes in ((torch.bfloat16, "bfloat16", 2), (torch.float32, "float32", 4)):
        t = gg.TILES[key]
        experts, segment_rows, n, k = 8, 2 * t.base_m, 4 * t.base_n, 4 * t.base_k * t.stages
        tiles = experts * (segment_rows // t.base_m) * (n // t.base_n)
        plan = t.buffers(out_bytes)
        found.append(dict(
            name=f"grouped_gemm_{dtype}", module="grouped_gemm", builder="grouped_gemm_kernel",
            kwargs=dict(experts=experts, segment_rows=segment_rows, n=n, k=k, base_m=t.base_m, base_n=t.base_n,
                        base_k=t.base_k, stages=t.stages, cores=cores, offsets=layout(plan, platform), dtype=dtype),
            blocks=cores, rounds=-(-tiles // cores), plan=plan, names={},
            shapes={"acc": (t.base_m, t.base_n), "a_l1": (2 * t.stages * t.base_m, t.base_k),
                    "b_l1": (2 * t.stages * t.base_n, t.base_k), "a_l0": (2 * t.base_m, t.base_k),
                    "b_l0": (2 * t.base_k, t.base_n), "acc_ub": (t.base_m // 2, t.base_n),
                    "out_ub": (t.base_m, t.base_n)}, gm_strides={}))
    t = gg.TILES["fp8"]
    experts, segment_rows, n, k = 8, 2 * t.base_m, 4 * t.base_n, 2 * t.base_k * t.stages
    plan = t.fp8_buffers(k)
    found.append(dict(
        name="grouped_gemm_fp8", module="grouped_gemm_fp8", builder="grouped_gemm_fp8_kernel",
        kwargs=dict(experts=experts, segment_rows=segment_rows, n=n, k=k, base_m=t.base_m, base_n=t.base_n,
                    base_k=t.base_k, stages=t.stages, cores=cores, offsets=layout(plan, platform)),
        blocks=cores, rounds=-(-experts * (segment_rows // t.base_m) * (n // t.base_n) // cores), plan=plan, names={},
        aliases={"b_bits": "b_row", "a_bits": "a_row"},
        shapes={"acc": (t.base_m, t.base_n), "a_l0": (2 * t.base_m, gg.SCALE_BLOCK),
                "b_l0": (2 * gg.SCALE_BLOCK, t.base_n), "partial": (t.base_m // 2, t.base_n),
                "a_scales": (t.base_m // 2, k // 64), "b_scales": (t.base_n, k // 64), "b_row": (1, t.base_n),
                "a_row": (1, t.base_m // 2)}, gm_strides={}))
    tokens, heads, dim, topk = cores, 2 * mla.HEAD_GROUP, 512, 4 * mla.KEY_TILE
    g, k, d = mla.HEAD_GROUP, mla.KEY_TILE, mla.D_SPLIT
    plan = mla.buffers(dim, 2)
    found.append(dict(
        name="mla_sparse_decode_bf16", module="mla_sparse_decode", builder="mla_sparse_decode_kernel",
        kwargs=dict(tokens=tokens, heads=heads, dim=dim, topk=topk, kv_rows=4096, head_group=g, key_tile=k,
                    d_split=d, cores=cores, scale=dim ** -0.5, offsets=layout(plan, platform)),
        blocks=cores, rounds=-(-tokens * heads // g // cores), plan=plan,
        names={"sink": "sink_ub", "indices": "index_ub", "reduce_scratch": "tmp_ub"},
        aliases={"p_l0": "q_l0", "v_l0": "k_l0"},
        shapes={"q_l1": (g, dim), "k_l1": (2 * k, dim), "q_l0": (2 * g, d), "k_l0": (2 * d, k),
                "p_l0": (g, k), "v_l0": (k, d), "scores": (2 * g, k), "pv": (g, d),
                "out_acc": (dim // d * g // 2, d), "probs": (g // 2, k)},
        gm_strides={}))
    vector_cores, rope_dim = 2 * cores, 64
    rows = ar.row_tile(rope_dim, 2, platform)
    plan = ar.plan_buffers(rows, rope_dim, 2)
    rope_names = ("rope", "partner", "cos", "sin", "table", "swap_offsets", "cos_offsets", "sin_offsets", "sign")
    heads, dim = 64, 512  # the V4.1 queries: 64 heads of 512, the trailing 64 rotate
    found.append(dict(
        name="apply_rope_bf16_h64", module="apply_rope", builder="apply_rope_kernel",
        kwargs=dict(tokens=2 * vector_cores * rows // heads, heads=heads, dim=dim, rope_dim=rope_dim, table_rows=4096,
                    tile_rows=rows, vector_cores=vector_cores, offsets=layout(plan, platform)),
        blocks=cores, rounds=2, plan=plan, names={"gather_scratch": "tmp_ub_1"},
        shapes={"rope_in": (2 * rows, rope_dim), **{name: (rows, rope_dim) for name in rope_names}},
        gm_strides={"step": vector_cores * rows * dim, "block": 2 * rows * dim, "sub": rows * dim}))
    for fmt in ("bf16", "fp8", "index_fp4", "fp4"):
        dim = 128 if fmt == "index_fp4" else 512
        rows = kv.row_tile(dim, rope_dim, 2, fmt, platform)
        plan = kv.plan_buffers(rows, dim, rope_dim, 2, fmt)
        group = kv.SCALE_BLOCK.get(fmt, 1)
        blocks = rows * dim // group
        scales = dict(aliases={"magnitudes": "squares", "work_blocks": "work", "max_bits": "block_max",
                               "recip_bits": "recip"},
                      shapes={"magnitudes": (blocks, group), "work_blocks": (blocks, group), "block_max": (1, blocks),
                              "recip": (1, blocks), "max_bits": (1, blocks), "recip_bits": (1, blocks)})
        half = dim // 2
        fp4 = dict(aliases={**scales["aliases"], "steps": "squares", "byte_half": "squares", "decoded_blocks": "codes",
                            "pairs": "work", "low_codes": "work", "high_codes": ("work", rows * half * 4),
                            "code_bytes": "packed"},
                   shapes={**scales["shapes"], "steps": (rows, dim), "codes": (rows, dim),
                           "decoded_blocks": (blocks, group), "pairs": (2 * rows, half), "low_codes": (rows, half),
                           "high_codes": (rows, half), "pair_offsets": (2 * rows, half), "byte_half": (rows, half),
                           "packed": (2 * rows, half), "code_bytes": (rows, half)})
        views = {"bf16": {},
                 "fp8": dict(aliases={**scales["aliases"], "code_bytes": "squares", "codes": "squares"},
                             shapes={**scales["shapes"], "code_bytes": (4 * rows, dim), "codes": (rows, dim)}),
                 "index_fp4": fp4,
                 "fp4": dict(aliases={**fp4["aliases"], "scale_codes": ("packed", rows * half),
                                      "scale_rows": ("packed", rows * half)},
                             shapes={**fp4["shapes"], "scale_codes": (1, blocks),
                                     "scale_rows": (rows, dim // group)})}[fmt]
        floor = {"fp8": FP8_AMAX_FLOOR, "index_fp4": MXFP4_AMAX_FLOOR, "fp4": NVFP4_AMAX_FLOOR}.get(fmt)
        found.append(dict(
            name=f"kv_norm_rope_store_{fmt}", module="kv_norm_rope_store", builder="kv_norm_rope_store_kernel",
            kwargs=dict(rows=2 * vector_cores * rows, dim=dim, rope_dim=rope_dim, table_rows=4096, cache_rows=8192,
                        tile_rows=rows, vector_cores=vector_cores, eps=1e-6, fmt=fmt,
                        offsets=layout(plan, platform), **({"amax_floor": floor} if floor else {})),
            blocks=cores, rounds=2, plan=plan,
            names={"weight": "weight_ub", "slots": "slot_ub", "reduce_scratch": "tmp_ub", "gather_scratch": "tmp_ub_1"},
            aliases=views.get("aliases", {}),
            shapes={"rows_in": (2 * rows, dim), "work": (rows, dim), "squares": (rows, dim), "weight_ub": (1, dim),
                    **{name: (rows, rope_dim) for name in rope_names}, **views.get("shapes", {})},
            gm_strides={"step": vector_cores * rows * dim, "block": 2 * rows * dim, "sub": rows * dim}))
    found.extend(mla_cases(cores, platform))
    for case in found:
        case.update(target=target, platform=platform)
    return found


def mla_cases(cores: int, platform: str) -> list[dict]:
    """The sparse MLA kernels over quantized caches and over a latent buffer with padding: decode
    from an ``fp8`` cache, decode from an ``fp8`` main list and an ``fp4`` extra list, and prefill,
    their two index lists padded to whole key tiles."""
    from deepinfer_backends.ascend950.buffers import layout
    from deepinfer_backends.ascend950.emulate import mla

    g, k, d, dim, heads = mla.HEAD_GROUP, mla.KEY_TILE, mla.D_SPLIT, 512, 2 * mla.HEAD_GROUP
    rounds = -(-mla.blocks(cores, heads) // cores)
    common = dict(names={"sink": "sink_ub", "indices": "index_ub", "reduce_scratch": "tmp_ub"},
                  aliases={"p_l0": "q_l0", "v_l0": "k_l0"},
                  shapes={"q_l1": (g, dim), "k_l1": (2 * k, dim), "q_l0": (2 * g, d), "k_l0": (2 * d, k),
                          "p_l0": (g, k), "v_l0": (k, d), "scores": (2 * g, k), "pv": (g, d),
                          "out_acc": (dim // d * g // 2, d), "probs": (g // 2, k), "mask_bias": (1, k)},
                  gm_strides={})
    found = []
    plan = mla.buffers(dim, 2, ("fp8",), masked=True)
    groups = dim // mla.SCALE_GROUP["fp8"]
    found.append(dict(
        common, name="mla_sparse_decode_fp8", module="mla_sparse_decode", builder="mla_sparse_decode_kernel",
        kwargs=dict(tokens=cores, heads=heads, dim=dim, topk=4 * k, kv_rows=4096, head_group=g, key_tile=k,
                    d_split=d, cores=cores, scale=dim ** -0.5, offsets=layout(plan, platform), cache_format="fp8",
                    masked=True),
        blocks=cores, rounds=rounds, plan=plan,
        aliases={**common["aliases"], "fp8_e4m3": "fp8_row", "fp8_packed": ("fp8_row", dim),
                 "fp8_bits": "fp8_scales"},
        shapes={**common["shapes"], "fp8_row": (1, 544), "fp8_e4m3": (groups, 32), "fp8_packed": (1, 16),
                "fp8_values": (groups, 32), "fp8_scales": (1, groups)}))
    main, total = mla.padded_lists(128 + 20, 128 + 20 + 100)
    plan = mla.buffers(dim, 2, ("fp8", "fp4"), masked=True)
    fp4_groups = dim // mla.SCALE_GROUP["fp4"]
    found.append(dict(
        common, name="mla_sparse_decode_fp8_fp4", module="mla_sparse_decode", builder="mla_sparse_decode_kernel",
        kwargs=dict(tokens=cores, heads=heads, dim=dim, topk=total, kv_rows=4096, head_group=g, key_tile=k,
                    d_split=d, cores=cores, scale=dim ** -0.5, offsets=layout(plan, platform), cache_format="fp8",
                    masked=True, extra_format="fp4", extra_rows=8192, main_keys=main),
        blocks=cores, rounds=rounds, plan=plan,
        names={**common["names"], "gather_scratch": "tmp_ub_1"},
        aliases={**common["aliases"], "fp8_e4m3": "fp8_row", "fp8_packed": ("fp8_row", dim),
                 "fp8_bits": "fp8_scales", "fp4_code_bytes": "fp4_row", "fp4_scale_e4m3": ("fp4_row", dim // 2),
                 "fp4_flat": "fp4_values", "fp4_low": "fp4_pairs",
                 "fp4_high": ("fp4_pairs", dim * 2), "fp4_floors": "fp4_signs"},
        shapes={**common["shapes"], "fp8_row": (1, 544), "fp8_e4m3": (groups, 32), "fp8_packed": (1, 16),
                "fp8_values": (groups, 32), "fp8_scales": (1, groups), "fp4_row": (1, 288),
                "fp4_code_bytes": (1, dim // 2), "fp4_scale_e4m3": (1, fp4_groups), "fp4_values": (fp4_groups, 16),
                "fp4_flat": (1, dim), "fp4_scales": (1, fp4_groups), "fp4_half": (1, dim // 2),
                "fp4_pairs": (1, dim), "fp4_low": (1, dim // 2), "fp4_high": (1, dim // 2), "fp4_signs": (1, dim),
                "fp4_floors": (1, dim // 2), "fp4_offsets": (1, dim)}))
    plan = mla.buffers(dim, 2, masked=True)
    found.append(dict(
        common, name="mla_sparse_prefill_bf16", module="mla_sparse_prefill", builder="mla_sparse_prefill_kernel",
        kwargs=dict(tokens=cores, heads=heads, dim=dim, topk=total, main_keys=main, kv_rows=4096, head_group=g,
                    key_tile=k, d_split=d, cores=cores, scale=dim ** -0.5, offsets=layout(plan, platform)),
        blocks=cores, rounds=rounds, plan=plan))
    return found


def gm_strides(source: str) -> dict[str, int]:
    """Coefficients of ``step``, ``block`` and ``sub`` in the first GM load's offset."""
    match = re.search(r"copy_gm_to_ub\w*<[^>]*>\(\w+ \+ \(([^,]*)\), pto::Shape", source)
    if not match:
        return {}
    return {name: int(c) for name, c in re.findall(r"\((\w+) \* (\d+)\)", match.group(1))}


def compare(case: dict, lowered: Optional[dict]) -> list[dict]:
    """One row per check of ``case`` against its lowered ``source`` (or its ``error``); with
    ``lowered`` None, the expectations alone (status ``not lowered``)."""
    from deepinfer_backends.ascend950.buffers import layout

    offsets = layout(case["plan"], case["platform"])
    source = (lowered or {}).get("source", "")
    tiles = lowering.buffers(source)
    rows = []

    def row(check, expected, got, status=None):
        if lowered is None:
            status = "not lowered"
        elif "error" in lowered:
            status, got = "lowering failed", lowered["error"][:300]
        rows.append({"kernel": case["name"], "target": case["target"], "platform": case["platform"], "check": check,
                     "plan": expected, "lowered": got,
                     "status": status or ("agrees" if str(expected) == str(got) else "differs")})

    row("launch blocks", case["blocks"], lowering.launch_blocks(source))
    row("declarations inside calls", 0, len(DECLARATION_IN_CALL.findall(source)) if source else None)
    loop = re.search(r"for \(int32_t step = 0; step < (\d+);", source)
    row("rounds per core", case["rounds"], int(loop.group(1)) if loop else (1 if source else None))
    scratch = [(offsets[b.name], offsets[b.name] + b.bytes * b.copies) for b in case["plan"]
               if b.name in COMPILER_SCRATCH]
    reserved = (min(start for start, _ in scratch), max(end for _, end in scratch)) if scratch else (0, 0)
    for buffer in case["plan"]:
        name = case["names"].get(buffer.name, buffer.name)
        size = -(-buffer.bytes * buffer.copies // ALIGN) * ALIGN
        tile = tiles.get(name)
        merged = "merged" if source and tile is None else None
        got = tile and -(-tile["bytes"] // ALIGN) * ALIGN
        if buffer.name in COMPILER_SCRATCH:  # the lowering sizes and places it, in the plan's reservation
            within = tile is not None and reserved[0] <= tile["offset"] and tile["offset"] + got <= reserved[1]
            row(f"{buffer.scope} {buffer.name} offset (within the scratch reserved at {reserved[0]}..{reserved[1]})",
                offsets[buffer.name], tile and tile["offset"], merged or ("agrees" if within else "differs"))
            row(f"{buffer.scope} {buffer.name} bytes (at most)", size, got,
                merged or ("agrees" if got is not None and got <= size else "differs"))
        else:
            row(f"{buffer.scope} {buffer.name} offset", offsets[buffer.name], tile and tile["offset"], merged)
            row(f"{buffer.scope} {buffer.name} bytes", size, got, merged)
    for name, planned in case.get("aliases", {}).items():
        planned, delta = planned if isinstance(planned, tuple) else (planned, 0)
        tile = tiles.get(name)
        row(f"{name} offset (in {planned}'s slot{f' + {delta} B' if delta else ''})", offsets[planned] + delta,
            tile and tile["offset"])
    for name, shape in case["shapes"].items():
        tile = tiles.get(name)
        row(f"{name} tile shape", f"{shape[0]}x{shape[1]}", tile and f"{tile['rows']}x{tile['cols']}")
    if case["gm_strides"]:
        strides = gm_strides(source)
        for index, stride in case["gm_strides"].items():
            row(f"GM offset per {index}", stride, strides.get(index))
    return rows


def check(python: Optional[str], target: str = "pto", platform: str = "A5") -> tuple[list[dict], dict]:
    """Lower every case with ``python`` (None: in this interpreter) and compare; the rows and the
    timings."""
    jobs = cases(target, platform)
    start = time.time()
    answer = lowering.lower(python, [{key: case[key] for key in ("name", "module", "builder", "kwargs", "target",
                                                                   "platform")} for case in jobs])
    timings = {"wall_seconds": round(time.time() - start, 1), "import_seconds": answer["import_seconds"],
               **{case["name"]: answer[case["name"]]["seconds"] for case in jobs}}
    return [r for case in jobs for r in compare(case, answer[case["name"]])], timings


def main(argv=None) -> int:
    _, settings = compose_study("ascend_lower", Settings, argv)
    if settings.lower:
        python = settings.python or (os.environ.get("ASCEND_ENV") and str(Path(os.environ["ASCEND_ENV"]) / "python"))
        if not python:
            raise ConfigError("study.python is unset and so is ASCEND_ENV: give the command of an interpreter with "
                              "tilelang-ascend (study.python=...), or the folder experiments/ascend_lower_setup.sh "
                              "filled (ASCEND_ENV=...), or run study.lower=false")
        rows, timings = check(python, settings.target, settings.platform)
        print("timings (s):", timings)
    else:
        rows = [r for case in cases(settings.target, settings.platform) for r in compare(case, None)]
    for r in rows:
        print(f"{r['kernel']:<24} {r['check']:<28} plan {str(r['plan']):>10}  lowered {str(r['lowered'])[:40]:>10}  "
              f"{r['status']}")
    path = write_results(settings.results_path("ascend_lower"), rows, study_command("ascend_lower", argv))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
