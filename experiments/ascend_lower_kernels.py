"""Lowering the ascend950 kernels with tilelang-ascend and reading the lowered source back, for
:mod:`ascend_lower` (the study). tilelang-ascend exists only as an aarch64 CPython 3.11 wheel, so
on other machines the lowering runs in another interpreter (an aarch64 Python under
qemu-user-static, set up by ``experiments/ascend_lower_setup.sh``): :func:`lower` sends it the
jobs as JSON on stdin and this file, run as that interpreter's script, answers with each
kernel's source and lowering time. The parsing functions need only the standard library."""
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "backends" / "ascend950" / "kernels"
PACKAGE = "ascend950_kernels"
"""The name the kernels folder is imported under in the lowering interpreter."""

LOCAL = re.compile(r"(Tile\w*|L0\w*|L1\w*)<([\w:]+), (\d+), (\d+)[^>]*> (\w+);\s*TASSIGN\(\w+, (\d+)\);")
LAUNCH = re.compile(r"<<<(\d+), ")
BYTES = {"bfloat16_t": 2, "half": 2, "float": 4, "int": 4, "uint8_t": 1, "int8_t": 1, "int16_t": 2,
         "uint32_t": 4, "float8_e4m3_t": 1}


def lower(python: str | None, jobs: list[dict], timeout: float = 900) -> dict:
    """Each job (``name``, ``module``: a file under ``backends/ascend950/kernels``, ``builder``,
    ``kwargs``, optional ``target``, ``platform`` and ``pass_configs``) lowered by ``python`` (the
    command of an interpreter with tilelang-ascend; None: this one, in process); by name,
    ``source`` or ``error``, and ``seconds``, plus ``import_seconds``."""
    if python is None:
        return lower_here(jobs)
    done = subprocess.run([*python.split(), __file__], input=json.dumps(jobs), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{python} {__file__} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def buffers(source: str) -> dict[str, dict]:
    """The named on-chip tiles of a lowered PTO source: element type, rows, columns, byte offset
    (``TASSIGN``) and bytes, by name; views (``<name>_temp_<i>``) left out."""
    found = {}
    for match in LOCAL.finditer(source):
        kind, element, rows, cols, name, offset = match.groups()
        if re.search(r"_temp_\d+$", name):
            continue
        element = element.split("::")[-1]
        found[name] = {"kind": kind, "element": element, "rows": int(rows), "cols": int(cols),
                       "offset": int(offset), "bytes": int(rows) * int(cols) * BYTES.get(element, 0)}
    return found


def launch_blocks(source: str) -> int | None:
    """The block count of the host's kernel launch (``<<<blocks, ...>>>``), or None."""
    match = LAUNCH.search(source)
    return int(match.group(1)) if match else None


def lower_here(jobs: list[dict]) -> dict:
    """:func:`lower` in this interpreter."""
    start = time.time()
    import tilelang

    answer = {"import_seconds": round(time.time() - start, 1)}
    for job in jobs:
        start = time.time()
        try:
            func = getattr(kernel_module(job["module"]), job["builder"])(**job["kwargs"])
            with tilelang.tvm.transform.PassContext(config=job.get("pass_configs", {})):
                artifact = tilelang.lower(func, target=job.get("target", "pto"), platform=job.get("platform", "A5"))
            answer[job["name"]] = {"source": artifact.kernel_source}
        except Exception as error:  # each kernel's failure is a result of its own
            text = str(error)
            message = [line for line in text.splitlines() if "Error" in line or "Check failed" in line]
            answer[job["name"]] = {"error": f"{type(error).__name__}: {' | '.join(message[-3:]) or text[-2000:]}"}
        answer[job["name"]]["seconds"] = round(time.time() - start, 2)
    return answer


def kernel_module(name: str):
    """Module ``name`` of ``backends/ascend950/kernels``, imported as a submodule of a package made
    from that folder (so the modules' relative imports of one another resolve) without importing
    deepinfer."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, KERNELS / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.{name}")


def _serve() -> None:
    print(json.dumps(lower_here(json.loads(sys.stdin.read()))))


if __name__ == "__main__":
    _serve()
