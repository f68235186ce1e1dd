import subprocess
import sys


def test_demo_runs_and_matches_torch_optim():
    out = subprocess.run([sys.executable, "-m", "sofx.demo", "--steps", "20"], capture_output=True, text=True,
                         check=True).stdout
    assert "max |sofx - torch.optim.AdamW| = 0.0e+00" in out
