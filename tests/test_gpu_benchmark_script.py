"""``benchmarks/gpu_kernels.py`` runs end to end (``--smoke``: CPU tensors under the Triton interpreter).

A GPU is lent to a session only now and then, for minutes: the script it runs must work the first
time. The smoke run goes through the same code (correctness check against the reference, every
storage configuration, the timing tables, the file written to ``$OUT``) at tiny sizes. The runs that need
no interpreter share one process (``script_runner``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from script_runner import ScriptRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_gpu_benchmark_script_smoke_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernels.py"), "--smoke"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    # the correctness table comes first; the timing tables after it
    assert proc.returncode == 0, proc.stdout[:6000] + "\n...\n" + proc.stdout[-2000:] + proc.stderr[-4000:]
    written = (tmp_path / "gpu_kernels.md").read_text()
    checks = [line for line in written.splitlines()
              if line.startswith("| float32 /") or line.startswith("| bfloat16 /")]
    judged = [line for line in checks if "| cpu_fast |" in line]
    assert len(checks) == 12 and len(judged) == 6 and all(line.endswith("| yes |") for line in judged), written
    for config in ("params float32, states float32", "params bfloat16, states float32",
                   "params bfloat16, states bfloat16"):
        assert config in written
    assert written.count("sofx triton undo+redo (fused, clip: same gradient)") == 3
    assert written.count("sofx triton step + bf16 copy (p_copy)") == 3
    assert "### GPT-2 small: 16 tensors" in written and "| sofx triton step, one call per tensor |" in written
    assert "| sofx triton step_many (one launch) |" in written
    assert "| sofx.adamw(backend='triton').update, donated |" in written


@pytest.fixture(scope="module")
def scripts():
    """One process for the runs here that need no Triton interpreter (see script_runner): without
    ``TRITON_INTERPRET``, which the Triton kernels read when they are defined."""
    runner = ScriptRunner(ROOT, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    yield runner
    runner.close()


def test_gpu_benchmark_script_refuses_a_smoke_run_without_the_interpreter(scripts):
    proc = scripts.run(os.path.join(ROOT, "benchmarks", "gpu_kernels.py"), ["--smoke"], timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stdout


def test_back_to_back_script_says_when_there_is_no_gpu(scripts):
    proc = scripts.run(os.path.join(ROOT, "benchmarks", "gpu_back_to_back.py"), [], timeout=120)
    if torch.cuda.is_available():
        assert proc.returncode == 0 and "| 2^28 | sofx triton step |" in proc.stdout
    else:
        assert proc.returncode == 0 and "no CUDA device here" in proc.stdout


def test_gpu_offload_script_smoke_run(scripts, tmp_path):
    """``benchmarks/gpu_offload.py --smoke`` (a tiny model on the CPU): every variant, and the sofx
    variants' parameters equal the plain-torch offload's after the same steps (exit status 1 otherwise)."""
    proc = scripts.run(os.path.join(ROOT, "benchmarks", "gpu_offload.py"), ["--smoke"], timeout=300,
                       env={"OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = (tmp_path / "gpu_offload.md").read_text()
    rows = [line.split(" | ")[0] for line in written.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["| backward", "| gpu fused", "| cpu offload, torch", "| sofx serial", "| sofx speculative"]


@pytest.mark.parametrize("script", ["gpu_kernels.py", "gpu_back_to_back.py"])
def test_gpu_benchmark_scripts_print_their_usage_with_help(script, scripts):
    """``--help`` prints the usage and exits 0 before the CUDA check (which says "no CUDA device here")."""
    proc = scripts.run(os.path.join(ROOT, "benchmarks", script), ["--help"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "no CUDA device" not in proc.stdout, (
        proc.stdout + proc.stderr)
