import re
import subprocess
import sys


def test_demo_trains_speculatively_and_matches_torch_optim():
    out = subprocess.run([sys.executable, "-m", "sofx.demo", "--steps", "20"], capture_output=True, text=True,
                         check=True, timeout=240).stdout
    assert "steps: 20" in out
    speculated = int(re.search(r"speculation: speculated (\d+)", out).group(1))
    assert speculated > 0, out
    assert re.search(r"backward\+step time \(median\): serial [\d.]+ ms, speculative [\d.]+ ms", out), out
    match = re.search(r"max relative deviation per step from torch\.optim\.AdamW .*: ([\d.e+-]+) "
                      r"\(tolerance 1e-06\): OK", out)
    assert match and float(match.group(1)) <= 1e-6, out
