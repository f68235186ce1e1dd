"""The spawned gloo groups of the distributed tests (``helpers.run_gloo_cases``, ``helpers.init_gloo``).

Ranks that start seconds apart (importing torch on a loaded machine) still meet: the group's short timeout,
there to turn a rank waiting alone in a case's collective into an error, covered the rendezvous too, and the
rank that came first failed with it. The cases' collectives keep the short timeout.

A rank killed by a signal of its own (gloo's transport threads abort the process on a socket error) costs one
more run, with a warning that shows the first run's logs; killed again, the test fails with each rank's exit and
the end of its log.
"""

from __future__ import annotations

import functools
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

from helpers import run_gloo, run_gloo_cases

# The spawned ranks' ``sitecustomize`` (their PYTHONPATH): the second rank to start sleeps {late} s first, before it
# imports anything (as a rank on a loaded machine imported torch that much later than the other).
_LATE_RANK = """\
import os
import time

with open("/proc/self/cmdline", "rb") as _f:
    _IS_A_RANK = b"spawn_main" in _f.read()
if _IS_A_RANK:
    try:
        os.close(os.open({mark!r}, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep({late})
"""


def _collective_timeout_s(rank: int) -> float:
    """The timeout of the group's collectives, in seconds."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_ranks_that_start_seconds_apart_meet_and_the_cases_keep_their_short_timeout(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second rank comes 3 s late, three times the cases' timeout (made 1 s; 10 s by default): the ranks meet,
    run the case, and its collectives have the 1 s timeout."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_LATE_RANK.format(mark=str(tmp_path / "first_rank"), late=3.0))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    ranks = run_gloo_cases({"timeout": _collective_timeout_s}, 2, tmp_path, timeout_s=300, case_timeout_s=1.0)
    assert [res["timeout"] for res in ranks] == [1.0, 1.0]


def _rank_1_aborts(every_run: bool, rank: int, world: int, store: str, outdir: str) -> None:
    """Rank 1 says so in its log and aborts: on every run, or on the first only (not on the run again,
    ``.../again``); the others save their rank."""
    if rank == 1 and (every_run or not outdir.endswith("again")):
        print(f"rank 1 aborts ({'every run' if every_run else 'the first run'})", flush=True)
        os.abort()
    torch.save({"rank": rank}, os.path.join(outdir, f"rank{rank}.pt"))


def test_a_rank_lost_to_a_signal_runs_once_more_with_a_warning_that_shows_its_log(tmp_path: pathlib.Path) -> None:
    shown = r"(?s)lost a rank to a signal.*rank 1: killed by SIGABRT.*rank 1 aborts \(the first run\)"
    with pytest.warns(UserWarning, match=shown):
        assert run_gloo(functools.partial(_rank_1_aborts, False), 2, tmp_path) == [{"rank": 0}, {"rank": 1}]


def test_a_rank_lost_to_a_signal_twice_fails_the_test_with_each_ranks_exit_and_log(tmp_path: pathlib.Path) -> None:
    with pytest.warns(UserWarning, match="lost a rank to a signal"), pytest.raises(pytest.fail.Exception) as err:
        run_gloo(functools.partial(_rank_1_aborts, True), 2, tmp_path)
    text = str(err.value)
    assert "process 1 terminated with signal SIGABRT" in text, text
    assert "--- rank 1: killed by SIGABRT; the end of rank1.log:\nrank 1 aborts (every run)" in text, text
    assert "--- rank 0: " in text, text
