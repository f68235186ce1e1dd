"""``cpu`` gives torch's bits whichever code path MKL takes for its square root.

MKL picks the code path of its vector math by the CPU at run time: its AVX-512 one on Intel CPUs with
AVX-512, its AVX2 one on Intel CPUs with AVX2 but not AVX-512, its generic one on AMD CPUs (with or
without AVX-512). Each rounds ``torch.sqrt``'s float32 results its own way, and the native kernels
reproduce each inline (a replica per path, chosen by a check at load). ``MKL_ENABLE_INSTRUCTIONS`` caps
the instructions MKL may use, so one machine runs the other paths too: in a process with the cap, the
load-time check must accept that path's replica (on Intel CPUs: AVX2 -> the AVX2 path's, SSE4_2 -> the
generic one's) and, with it, the comparisons of tests/test_cpu_mkl_sqrt.py (every float32 among them)
and ``cpu``'s bitwise tests pass, in the native build and in the AVX2 build (``other_build``'s "avx2":
the 8-lane loops with the replica inline).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sofx.kernels import _cpu_build, cpu

HERE = os.path.dirname(os.path.abspath(__file__))
# cpu's bitwise tests: torch.optim's step, the reference's step / undo / undo+redo for every variant and
# dtype, decayed rows (second moments among the tiny normal floats, where the paths differ most), the AVX2
# build against the native one
KERNEL_TESTS = ("test_cpu_step_is_torch_optim_bit_for_bit or (test_step_undo_undo_redo_match_reference and not "
                "cpu_fast) or test_cpu_on_decayed_rows_is_torchs or (test_another_build_gives_the_same_bits and "
                "avx2 and not without)")
EXPECTED_ON_INTEL = {"AVX2": "avx2", "SSE4_2": "generic"}

pytestmark = pytest.mark.skipif(
    not (cpu.native_available() and _cpu_build.load().sqrt_fn),
    reason="needs the native kernels and torch's MKL square root")


def _capped(isa: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": isa}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900, env=env, cwd=HERE)


# The library's replica and whether it gives torch's bits, printed first; then, where there is a replica, cpu's
# tests run in the same process (pytest.main: one start of Python, torch and sofx, not two).
_PROBE_THEN_TESTS = f"""
import sys
import pytest
from sofx.kernels import _cpu_build as b
lib = b.load()
print(lib.sqrt_replica, int(lib.bitwise_torch), flush=True)
if lib.sqrt_replica:
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_cpu_mkl_sqrt.py",
                          "test_kernels_cpu.py", "-k", {f"test_cpu_mkl_sqrt.py or ({KERNEL_TESTS})"!r}]))
"""


@pytest.mark.parametrize("isa", sorted(EXPECTED_ON_INTEL))
def test_each_mkl_code_path_is_replicated(isa):
    run = _capped(isa, "-c", _PROBE_THEN_TESTS)
    lines = run.stdout.strip().splitlines()
    assert lines and len(lines[0].split()) == 2, run.stdout[-4000:] + run.stderr[-2000:]
    replica, bitwise = map(int, lines[0].split())
    names = {kind: name for name, kind in _cpu_build.REPLICA_KINDS.items()}
    if _cpu_build._cpuinfo_field("vendor_id") == "GenuineIntel":
        assert names.get(replica) == EXPECTED_ON_INTEL[isa] and bitwise, (isa, replica)
    if not replica:
        assert run.returncode == 0, run.stderr
        pytest.skip(f"no replica of MKL's square root accepted under MKL_ENABLE_INSTRUCTIONS={isa} here")
    summary = lines[-1]
    assert run.returncode == 0 and "passed" in summary, run.stdout[-4000:] + run.stderr[-2000:]
