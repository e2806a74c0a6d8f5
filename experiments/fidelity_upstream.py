"""DeepInfer 0.1.0's own PyTorch reference functions, for :mod:`fidelity`: the ``deepinfer`` and
``tile_kernels`` sdists fetched from the index pip is configured with (JSON simple API, sha256
checked) and imported at run time under their own package name, ours set aside while they import.
Imports that need CUDA, the native extension or Python 3.12 are replaced by stubs (:data:`STUBS`);
:class:`CpuForCuda` sends their ``device="cuda"`` to the CPU. Nothing of theirs is copied here."""
from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import json
import subprocess
import sys
import tarfile
import types
import urllib.request
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

SDISTS = {"deepinfer": "0.1.0", "tile_kernels": "2.1.0"}
TILELANG_OPS = "deepinfer.model_executor.layers.tilelang_ops"
UPSTREAM_MODULES = {
    "tk": "tile_kernels.torch", "sample": f"{TILELANG_OPS}.fused_sample", "draw": f"{TILELANG_OPS}.random_sampling",
    "verify": f"{TILELANG_OPS}.sampler", "norm": f"{TILELANG_OPS}.norm", "cache": f"{TILELANG_OPS}.cache_common",
    "compress": f"{TILELANG_OPS}.compress", "rope": "deepinfer.model_executor.layers.rotary_embedding",
    "logits": "deepinfer.model_executor.layers.sampler_utils", "engine": "deepinfer._C.engine",
}
STUBS = {
    "deepinfer._C": "native extension package (not in the sdist)",
    "deepinfer._C.engine": "native extension (not in the sdist): LogitsTransformInputs and SamplingKernelInputs as "
                           "plain records with the fields of its .pyi",
    "deepinfer.model_executor.utils": "Python 3.12 syntax; reconstruct_param as the identity",
    "deepinfer.model_executor.parallel_utils.parallel_state": "needs deep_ep and NCCL; unused by get_logits",
    "deepinfer.sequence": "imports the native extension; unused by get_logits",
    "deep_gemm": "CUDA GEMMs: bf16_gemm_nt(a, b, d) as d = float32 product of the bf16 operands",
    "deep_select": "CUDA top-k; unused by the functions called",
    "deep_select.interface": "CUDA top-k; unused by the functions called",
}

def fetch_sources(dest: Path) -> Path:
    """Download the two sdists from pip's index (JSON simple API, sha256 checked) and unpack them in ``dest``."""
    index = _pip_index_url().rstrip("/")
    for name, version in SDISTS.items():
        filename = f"{name}-{version}.tar.gz"
        request = urllib.request.Request(f"{index}/{name.replace('_', '-')}/",
                                         headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        entry = next(f for f in json.load(urllib.request.urlopen(request))["files"] if f["filename"] == filename)
        data = urllib.request.urlopen(entry["url"]).read()
        if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
            raise RuntimeError(f"{filename}: sha256 does not match the index's")
        (dest / filename).write_bytes(data)
        with tarfile.open(dest / filename) as archive:
            archive.extractall(dest, filter="data")
    return dest


def _pip_index_url() -> str:
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                capture_output=True, text=True).stdout.strip()
    return configured or "https://pypi.org/simple"


def load_upstream(source: Path) -> types.SimpleNamespace:
    """Their modules (:data:`UPSTREAM_MODULES`), imported from ``source``. While they import, the
    name ``deepinfer`` is theirs; ours is put back afterwards (their functions keep their own
    module globals and import nothing when called)."""
    sys.path.insert(0, str(source / f"tile_kernels-{SDISTS['tile_kernels']}"))
    with _their_deepinfer():
        root = types.ModuleType("deepinfer")
        root.__path__ = [str(source / f"deepinfer-{SDISTS['deepinfer']}" / "deepinfer")]
        sys.modules["deepinfer"] = root
        _install_stubs()
        root.PLATFORM = importlib.import_module("deepinfer.platform").PlatformGPU()
        return types.SimpleNamespace(**{key: importlib.import_module(name) for key, name in UPSTREAM_MODULES.items()})


@contextlib.contextmanager
def _their_deepinfer():
    ours = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "deepinfer"}
    try:
        yield
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "deepinfer"]:
            del sys.modules[name]
        sys.modules.update(ours)


def _install_stubs() -> None:
    def bf16_gemm_nt(a, b, d, c=None):
        d.copy_(a.float() @ b.float().T)

    engine = {"LogitsTransformInputs": collections.namedtuple("LogitsTransformInputs", "temperatures top_ps top_ks"),
              "SamplingKernelInputs": collections.namedtuple("SamplingKernelInputs", "logits seq_seeds sample_positions")}
    attributes = {"deepinfer._C.engine": engine,
                  "deepinfer.model_executor.utils": {"reconstruct_param": lambda param: param},
                  "deep_gemm": {"bf16_gemm_nt": bf16_gemm_nt}}
    for name in STUBS:
        module = types.ModuleType(name)
        module.__dict__.update(attributes.get(name, {}))
        module.__getattr__ = _unavailable(name)
        sys.modules[name] = module


def _unavailable(module: str):
    """``module.__getattr__``: any other name is a class that refuses to be built (annotations using
    it still evaluate)."""
    def attribute(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{module}.{name} is stubbed in experiments/fidelity.py ({STUBS[module]})")
        return type(name, (), {"__init__": refuse})
    return attribute


class CpuForCuda(TorchFunctionMode):
    """Runs code written for CUDA on the CPU: ``device="cuda"`` becomes the CPU and ``.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)
