"""Benchmark scripts run as ``__main__`` in one long-lived Python process, not a fresh process each.

A smoke run of a benchmark script spends most of its time starting Python and importing torch and sofx (about
3 s of a core); :class:`ScriptRunner` pays that once and runs each script in its process with ``runpy.run_path``
(``sys.argv`` set to the script and its arguments, its output captured), answering as ``subprocess.run`` would:
the exit code (0 at the script's end, ``sys.exit``'s code, 1 for an exception, whose traceback is on stderr),
stdout and stderr. A script that kills the process (a segmentation fault in native code) fails its own run, with
the process's exit code; the next run starts a fresh process. What a script changes in the process that the next
one would see (``sys.argv``, ``sys.path``, the environment, torch's thread count, SIGINT's handler) is put back
after it. Scripts that replace the process (``os.execve``) or read the environment before their imports
(``TRITON_INTERPRET``) must run in a process of their own.

Run as a program, this module is that process: a request per line on stdin (JSON: ``script``, ``args``, ``env``), a
reply per line on the stdout it was started with (JSON: ``returncode``, ``stdout``, ``stderr``); output that
bypasses ``sys.stdout`` (native code, child processes) goes to its stderr instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScriptRunner:
    """Runs scripts in one Python process (started at the first :meth:`run`, again after one ended it) in the
    working directory ``cwd`` and with the environment ``env`` (default: this process's)."""

    def __init__(self, cwd: str = ROOT, env: dict[str, str] | None = None) -> None:
        self._cwd, self._env = cwd, env
        self._proc: subprocess.Popen | None = None

    def run(self, script: str, args: list[str], timeout: float = 600.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``script`` run as ``__main__`` with ``sys.argv[1:] == args`` and the variables ``env`` set in the
        environment for it: its exit code, stdout and stderr (as ``subprocess.run(..., capture_output=True,
        text=True)`` gives them). Raises ``subprocess.TimeoutExpired`` (the process killed) where it runs longer
        than ``timeout`` seconds."""
        proc = self._started()
        command = [script, *args]
        try:
            proc.stdin.write(json.dumps({"script": script, "args": args, "env": env or {}}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # the process ended: reported below
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            self.close(kill=True)
            raise subprocess.TimeoutExpired(command, timeout)
        line = proc.stdout.readline()
        if not line:  # the script ended the process
            self.close()
            code = proc.returncode
            return subprocess.CompletedProcess(command, code if code else 1, "",
                                               f"the script runner's process ended (exit code {code}) running {script}")
        reply = json.loads(line)
        return subprocess.CompletedProcess(command, reply["returncode"], reply["stdout"], reply["stderr"])

    def close(self, kill: bool = False) -> None:
        """End the process: it ends at the end of its stdin, killed where it does not within 30 s (at once with
        ``kill``: a script still running)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def _started(self) -> subprocess.Popen:
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, cwd=self._cwd, env=self._env)
        return self._proc


def _exit_code(exit_: SystemExit) -> int:
    """The exit code of a process ended by ``exit_``, its message printed to stderr as Python prints it."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _run(script: str, args: list[str], env: dict[str, str]) -> dict:
    """``script`` run as ``__main__`` (``sys.argv`` = [script, *args], ``env`` set in the environment): its exit
    code and captured output; the process's state that a script changes is put back after it."""
    import runpy

    import torch

    saved = (list(sys.argv), list(sys.path), dict(os.environ), torch.get_num_threads(),
             signal.getsignal(signal.SIGINT))
    out, err = io.StringIO(), io.StringIO()
    try:
        sys.argv = [script, *args]
        os.environ.update(env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException:  # noqa: BLE001 (a script's failure is its exit code and traceback)
                traceback.print_exc()
                code = 1
    finally:
        sys.argv[:], sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])
        signal.signal(signal.SIGINT, saved[4])
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _serve() -> None:
    """Answer the requests on stdin until it ends (see the module's docstring)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # output that bypasses sys.stdout goes to stderr, not into the replies
    sys.path[0] = ROOT  # not tests/ (whose modules a script could take for its own); the scripts' own sofx
    import torch  # noqa: F401

    import sofx  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        replies.write(json.dumps(_run(request["script"], request["args"], request["env"])) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
