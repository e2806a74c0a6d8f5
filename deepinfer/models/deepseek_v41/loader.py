"""Read and write DeepSeek-V4.1 checkpoints in the official safetensors layout (Appendix B).

The model exchanges plain dicts, official name -> float tensor. On disk each tensor is stored as
:func:`~deepinfer.models.deepseek_v41.names.storage_format` says:

============  ================================================  ===================================
format        ``X.weight``                                      ``X.scale`` (UE8M0, ``F8_E8M0``)
============  ================================================  ===================================
``fp8``       ``F8_E4M3 [N, K]``                                ``[ceil(N/32), ceil(K/32)]``
``fp8_rows``  ``F8_E4M3 [N, K]``, K a multiple of 32            ``[N, K/32]`` (Engram tables)
``mxfp4``     ``U8 [N, K/2]``, e2m1, even index in low nibble   ``[N, K/32]``
``bf16``      ``BF16``                                          none
``fp32``      ``F32``                                           none
============  ================================================  ===================================

The reader also accepts ``I8`` packed FP4 and ``U8`` scale bytes, and an optional ``model.``
prefix on every name. Shards are listed in ``model.safetensors.index.json``; a checkpoint
without an index is a single ``model.safetensors``. ``F8_E8M0`` needs safetensors >= 0.6.
"""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from deepinfer.hal.formats import Quantized, dequantize, dequantize_weight_fp8, quantize, quantize_weight_fp8
from deepinfer.models.deepseek_v41.names import storage_format, strip_prefix

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BLOCK = 32
QUANTIZED_FORMATS = ("fp8", "fp8_rows", "mxfp4")
PER_ROW_FORMATS = {"fp8_rows": "fp8", "mxfp4": "mxfp4"}
"""Formats with a scale per 32 values of each row, and the quantized format of their values."""
STORED_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
READABLE_DTYPES = {"fp8": ("F8_E4M3",), "fp8_rows": ("F8_E4M3",), "mxfp4": ("U8", "I8"), "bf16": ("BF16",),
                   "fp32": ("F32",)}
READABLE_SCALE_DTYPES = ("F8_E8M0", "U8")
DECODED_QUANTIZATION = {"weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}


class LoaderError(ValueError):
    """A checkpoint on disk is missing, corrupt, or does not hold what the model expects."""


def scale_name(weight_name: str) -> str:
    """Name of the UE8M0 scale tensor of a quantized ``X.weight``: ``X.scale``."""
    return weight_name.removesuffix(".weight") + ".scale"


def stored_shapes(fmt: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """On-disk shapes of (weight, scale) for a float tensor of ``shape`` stored as ``fmt``."""
    if fmt == "fp8":
        n, k = shape
        return (n, k), (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    if fmt in PER_ROW_FORMATS:
        n, k = shape
        return (n, k // 2 if fmt == "mxfp4" else k), (n, k // BLOCK)
    return tuple(shape), None


def save_checkpoint(directory, config: dict, state_dict: dict[str, torch.Tensor],
                    max_shard_bytes: int = 2**30) -> None:
    """Write ``state_dict`` (official name -> float tensor) as an official V4.1 checkpoint.

    Creates ``directory`` with ``config.json`` (``config``, indented), shards
    ``model-0000i-of-0000N.safetensors`` of at most ``max_shard_bytes`` each (a tensor larger
    than that gets a shard of its own) and ``model.safetensors.index.json``. Tensors are
    quantized by their name's storage format (module docstring); names are written as given, so
    a ``model.`` prefix is kept. A weight and its scale always share a shard.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if not state_dict:
        raise ValueError("state_dict is empty; pass at least one tensor to save")
    sizes = {name: _stored_nbytes(name, tensor) for name, tensor in state_dict.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors.update(_encode(name, state_dict[name]))
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    _write_json(directory / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    _write_json(directory / CONFIG_FILE, config)


def _stored_nbytes(name: str, tensor: torch.Tensor) -> int:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        seen = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"state_dict[{name!r}] must be a float tensor, got {seen}")
    fmt = storage_format(name)
    if fmt not in QUANTIZED_FORMATS:
        return tensor.numel() * STORED_DTYPES[fmt].itemsize
    if tensor.dim() != 2 or (fmt in PER_ROW_FORMATS and tensor.shape[1] % BLOCK):
        need = f"[N, K] with K a multiple of {BLOCK}" if fmt in PER_ROW_FORMATS else "[N, K]"
        raise ValueError(f"state_dict[{name!r}] is stored as {fmt} and must be {need}, got {tuple(tensor.shape)}")
    data_shape, scale_shape = stored_shapes(fmt, tuple(tensor.shape))
    return math.prod(data_shape) + math.prod(scale_shape)


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    shards.append(current)
    return shards


def _encode(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    fmt = storage_format(name)
    if fmt not in QUANTIZED_FORMATS:
        return {name: tensor.detach().to("cpu", STORED_DTYPES[fmt], copy=True, memory_format=torch.contiguous_format)}
    weight = tensor.detach().to("cpu", torch.float32)
    if fmt == "fp8":
        data, scale = quantize_weight_fp8(weight, BLOCK)
    else:
        packed = quantize(weight, PER_ROW_FORMATS[fmt], BLOCK)
        data, scale = packed.data, packed.scale
    return {name: data.contiguous(), scale_name(name): scale.contiguous().view(torch.float8_e8m0fnu)}


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


@dataclass(frozen=True)
class StoredTensor:
    """Where one on-disk tensor lives and what its header says."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointEntry:
    """One float tensor of the checkpoint: its format, stored parts and dequantized shape."""

    fmt: str
    data: StoredTensor
    scale: StoredTensor | None
    shape: tuple[int, ...]


def load_checkpoint(directory, expected_shapes: dict[str, tuple[int, ...]] | None = None,
                    dtype: torch.dtype = torch.float32, device="cpu",
                    quantized: bool = False) -> tuple[dict, dict[str, torch.Tensor | Quantized]]:
    """Read an official V4.1 checkpoint: ``(config dict, {official name: float tensor})``.

    Reads ``config.json`` and the shards named by the index (or a lone ``model.safetensors``),
    drops the optional ``model.`` prefix and dequantizes FP8 / MXFP4 weights exactly to ``dtype``
    on ``device``; with ``quantized`` they stay :class:`~deepinfer.hal.formats.Quantized` instead,
    with one UE8M0 scale per 32 along K (an FP8 weight's 32 x 32 scale repeated over its 32 rows;
    one whose K is not a multiple of 32 is dequantized). Every header is checked before any data
    is read; tensors are then read one at a time, shard by shard. With ``expected_shapes``
    (official name -> dequantized shape) the checkpoint must hold exactly those tensors with
    those shapes.

    Raises :class:`LoaderError`, naming the file and the tensor, for a missing or corrupt shard,
    an unknown, absent or misshapen tensor, a quantized weight without its scale (or a scale
    without its weight) and an unexpected on-disk dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    directory = Path(directory)
    config = _read_config(directory)
    source, catalogue = _catalogue(directory)
    entries = _pair_scales(catalogue)
    if expected_shapes is not None:
        _check_expected(entries, {strip_prefix(k): tuple(v) for k, v in expected_shapes.items()}, source)
    return config, _read_tensors(directory, entries, dtype, device, quantized)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LoaderError(f"{path.name} is missing from {path.parent}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoaderError(f"{path.name} in {path.parent} is not readable JSON: {error}") from error


def _read_config(directory: Path) -> dict:
    config = _read_json(directory / CONFIG_FILE)
    if not isinstance(config, dict):
        raise LoaderError(f"{CONFIG_FILE} in {directory} must hold a JSON object, got {type(config).__name__}")
    quantization = config.get("quantization_config") or {}
    for key, value in DECODED_QUANTIZATION.items():
        if key in quantization and quantization[key] != value:
            raise LoaderError(f"{CONFIG_FILE}: quantization_config.{key} is {quantization[key]!r}, not {value!r}")
    return config


def _shard_listing(directory: Path) -> tuple[str, dict[str, list[str]]]:
    """The file that lists the shards, and shard file -> tensor names it is said to hold."""
    if not (directory / INDEX_FILE).is_file():
        if not (directory / SINGLE_FILE).is_file():
            raise LoaderError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}; is it a checkpoint?")
        return SINGLE_FILE, {SINGLE_FILE: []}
    weight_map = _read_json(directory / INDEX_FILE)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
        raise LoaderError(f"{INDEX_FILE} in {directory} has no 'weight_map' object")
    listing = {}
    for key, file in weight_map.items():
        listing.setdefault(file, []).append(key)
    return INDEX_FILE, listing


def _open_shard(path: Path, keys: list[str]):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        held = ", ".join(repr(key) for key in keys[:3]) or "unknown tensors"
        raise LoaderError(f"cannot read shard {path.name} (holding {held}): {error}") from error


def _catalogue(directory: Path) -> tuple[str, dict[str, StoredTensor]]:
    source, listing = _shard_listing(directory)
    catalogue: dict[str, StoredTensor] = {}
    for file, listed in listing.items():
        if not (directory / file).is_file():
            raise LoaderError(f"shard {file}, which {source} says holds {listed[0]!r}, is missing from {directory}")
        with _open_shard(directory / file, listed) as shard:
            keys = sorted(shard.keys())
            absent = sorted(set(listed) - set(keys))
            if absent:
                raise LoaderError(f"{source} puts tensor {absent[0]!r} in {file}, but {file} does not hold it")
            for key in keys:
                name, header = strip_prefix(key), shard.get_slice(key)
                if name in catalogue:
                    raise LoaderError(f"{file}: tensor {key!r} is also stored in {catalogue[name].file}")
                catalogue[name] = StoredTensor(file, key, header.get_dtype(), tuple(header.get_shape()))
    return source, catalogue


def _pair_scales(catalogue: dict[str, StoredTensor]) -> dict[str, CheckpointEntry]:
    entries = {}
    for name, stored in catalogue.items():
        if name.endswith(".scale"):
            weight = name.removesuffix(".scale") + ".weight"
            if weight not in catalogue or storage_format(weight) not in QUANTIZED_FORMATS:
                raise LoaderError(f"{stored.file}: scale {stored.key!r} has no FP8/MXFP4 weight {weight!r}")
            continue
        fmt = storage_format(name)
        scale = catalogue.get(scale_name(name)) if fmt in QUANTIZED_FORMATS else None
        if fmt in QUANTIZED_FORMATS and scale is None:
            raise LoaderError(f"{stored.file}: {fmt} weight {stored.key!r} has no scale {scale_name(stored.key)!r}")
        entries[name] = _entry(fmt, stored, scale)
    return entries


def _check_dtype(stored: StoredTensor, allowed: tuple[str, ...], role: str) -> None:
    if stored.dtype not in allowed:
        raise LoaderError(f"{stored.file}: {role} {stored.key!r} is {stored.dtype}, expected {' or '.join(allowed)}")


def _entry(fmt: str, data: StoredTensor, scale: StoredTensor | None) -> CheckpointEntry:
    _check_dtype(data, READABLE_DTYPES[fmt], f"{fmt} tensor")
    if scale is None:
        return CheckpointEntry(fmt, data, None, data.shape)
    _check_dtype(scale, READABLE_SCALE_DTYPES, "scale")
    if len(data.shape) != 2:
        raise LoaderError(f"{data.file}: {fmt} weight {data.key!r} has shape {data.shape}; expected 2 dims")
    rows, columns = data.shape
    shape = (rows, 2 * columns) if fmt == "mxfp4" else (rows, columns)
    if fmt in PER_ROW_FORMATS and shape[1] % BLOCK:
        raise LoaderError(f"{data.file}: {fmt} weight {data.key!r} has K = {shape[1]}, not a multiple of {BLOCK}")
    scale_shape = stored_shapes(fmt, shape)[1]
    if scale.shape != scale_shape:
        raise LoaderError(f"{scale.file}: scale {scale.key!r} has shape {scale.shape}; expected {scale_shape} "
                          f"for {fmt} weight {data.key!r} of shape {shape}")
    return CheckpointEntry(fmt, data, scale, shape)


def _check_expected(entries: dict[str, CheckpointEntry], expected: dict[str, tuple[int, ...]], source: str) -> None:
    for name, entry in entries.items():
        file, key = entry.data.file, entry.data.key
        if name not in expected:
            raise LoaderError(f"{file}: unknown tensor {key!r} (not among the expected names)")
        if entry.shape != expected[name]:
            raise LoaderError(f"{file}: tensor {key!r} has shape {entry.shape}, expected {expected[name]}")
    absent = sorted(set(expected) - set(entries))
    if absent:
        raise LoaderError(f"{source}: expected tensor {absent[0]!r} is absent ({len(absent)} absent in all)")


class _ShardReader:
    """Opens each shard once, on first use, and reads single tensors from it."""

    def __init__(self, directory: Path, stack: ExitStack):
        self._directory, self._stack, self._shards = directory, stack, {}

    def read(self, stored: StoredTensor) -> torch.Tensor:
        if stored.file not in self._shards:
            shard = _open_shard(self._directory / stored.file, [stored.key])
            self._shards[stored.file] = self._stack.enter_context(shard)
        try:
            return self._shards[stored.file].get_tensor(stored.key)
        except (SafetensorError, OSError) as error:
            raise LoaderError(f"{stored.file}: cannot read tensor {stored.key!r}: {error}") from error


def _read_tensors(directory: Path, entries: dict[str, CheckpointEntry], dtype: torch.dtype, device,
                  quantized: bool) -> dict:
    by_file: dict[str, list[str]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry.data.file, []).append(name)
    state_dict = {}
    for names in by_file.values():
        with ExitStack() as stack:
            reader = _ShardReader(directory, stack)
            for name in names:
                value = _decode(entries[name], reader, device, quantized)
                state_dict[name] = value if isinstance(value, Quantized) else value.to(dtype)
    return state_dict


def _decode(entry: CheckpointEntry, reader: _ShardReader, device, quantized: bool) -> torch.Tensor | Quantized:
    data = reader.read(entry.data).to(device)
    if entry.scale is None:
        return data
    scale = reader.read(entry.scale).to(device).view(torch.uint8)
    if entry.fmt in PER_ROW_FORMATS:
        values = data.view(torch.uint8) if entry.fmt == "mxfp4" else data
        packed = Quantized(values, scale, PER_ROW_FORMATS[entry.fmt], BLOCK)
        return packed if quantized else dequantize(packed)
    if quantized and entry.shape[1] % BLOCK == 0:
        return Quantized(data, scale.repeat_interleave(BLOCK, dim=0)[:entry.shape[0]].contiguous(), "fp8", BLOCK)
    return dequantize_weight_fp8(data, scale, BLOCK)
