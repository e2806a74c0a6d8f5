"""The README's two set-up commands: the test command is what .ci/run runs, and the main job's
generation command runs as written."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _setup_commands()
    assert tests in (ROOT / ".ci" / "run").read_text()
    assert main_job.startswith("pip install torch==2.13.0 ") and tests.startswith("pip install torch==2.13.0 ")


def test_the_main_job_generates_on_the_cpu_reference_backend():
    main_job, _ = _setup_commands()
    generate = main_job.split("&&", 1)[1].strip()
    argv = shlex.split(generate)
    assert argv[:3] == ["python", "-m", "deepinfer"] and "backend=reference" in argv
    done = subprocess.run([sys.executable, *argv[1:], "decoding.max_tokens=8"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "random weights" not in done.stdout
    assert re.search(r"\[8 tokens, finish: length\]", done.stdout), done.stdout[-2000:]
