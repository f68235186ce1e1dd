"""The worker process of the process executor: :func:`main` (``python -m sofx.offload.process_worker ADDRESS``).

Started by :class:`sofx.offload.process_executor.ProcessExecutor` as a fresh
interpreter (not ``multiprocessing``: no re-import of the user's ``__main__``,
so scripts without an ``if __name__ == "__main__"`` guard and notebooks work),
which imports this module from the main process's ``sys.path`` (``process_executor._WORKER_CODE``).
It reads an authentication key from stdin, connects to the unix socket
``ADDRESS``, receives its configuration (the shared tensors' specs, block
layouts, the Adam configuration, the publish buffers -- all JSON-able), maps the
shared tensors through the descriptors it inherited (closing them then: the
mappings keep the memory) and answers ``("ready", pid)``. Then, for every
:class:`~sofx.offload.block_ops.BlockOp` received, it sends back one
:class:`~sofx.offload.block_ops.OpResult`, in order. ``None`` stops it. A
closed connection (the main process died or exited without closing the
optimizer, also while this process started) stops it too; the shared files
have no name (:mod:`sofx.offload.shared_memory`), so nothing is left behind.
A main process gone before this one connected leaves the socket's private
directory, which this process removes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import torch

from sofx.offload.block_runner import AdamConfig, BlockRunner
from sofx.offload.blocks import TENSOR_NAMES, BlockLayout, BlockTensors
from sofx.offload.shared_memory import SharedTensorSpec, close_fds, open_shared_tensor

__all__ = ["build_runner", "serve", "main"]


def build_runner(config: dict[str, Any]) -> BlockRunner:
    """The runner over the shared tensors described by ``config``."""
    layouts = [BlockLayout.from_json(d) for d in config["layouts"]]
    specs = {name: SharedTensorSpec.from_json(d) for name, d in config["tensors"].items()}
    tensors = {}
    for layout in layouts:
        opened = {what: open_shared_tensor(specs[layout.tensor_name(what)]) for what in TENSOR_NAMES}
        tensors[layout.index] = BlockTensors(**opened)
    publish = {int(b): [None if pair is None else [open_shared_tensor(specs[name]) for name in pair]
                        for pair in slots]
               for b, slots in config.get("publish", {}).items()}
    adam = AdamConfig(**config["adam"]).build()
    return BlockRunner(adam, layouts, tensors, publish)


def serve(conn: Connection) -> int:
    """Receive the configuration, then run operations until told to stop; returns the exit code (0 also where the
    main process is gone, before or after the start: nobody is left to tell)."""
    try:
        config = conn.recv()
    except (EOFError, OSError):
        return 0
    try:
        torch.set_num_threads(int(config.get("num_threads", 1)))
        torch.set_grad_enabled(False)
        runner = build_runner(config)
    except BaseException as exc:  # the main process raises this as a clear startup error
        try:
            conn.send(("failed", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
        except (EOFError, OSError):
            pass
        return 1
    finally:
        close_fds(list(config.get("fds", ())))  # mapped (or failed): the mappings hold the memory
    try:
        conn.send(("ready", os.getpid()))
        while True:
            op = conn.recv()
            if op is None:
                return 0
            conn.send(runner.run(op))
    except (EOFError, OSError):
        return 0  # the main process died without closing the optimizer (also while an operation ran)


def _connect(address: str, authkey: bytes) -> Connection | None:
    """The authenticated connection to the main process at ``address``; None where it cannot be made (the main
    process died before this one connected: the socket's private directory, left by it, is removed), said on
    stderr for a main process that still reads it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError as exc:
        sock.close()
        if os.path.basename(os.path.dirname(address)).startswith("sofx-worker-"):
            shutil.rmtree(os.path.dirname(address), ignore_errors=True)
        _say(f"sofx offload worker: cannot connect to {address}: {exc}")
        return None
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except (EOFError, OSError) as exc:
        conn.close()
        _say(f"sofx offload worker: the connection to {address} ended while authenticating: {exc!r}")
        return None
    return conn


def _say(line: str) -> None:
    """Write ``line`` to stderr, where something still reads it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: list[str]) -> int:
    """The worker process's entry: connect to ``argv[1]`` (the authkey on stdin), serve block operations until
    told to stop; returns the exit status."""
    if len(argv) != 2:
        print("usage: python -m sofx.offload.process_worker SOCKET_PATH  (authkey in hex on stdin)", file=sys.stderr)
        return 2
    # Ctrl-C in a terminal signals the whole process group: the main process decides what an interrupt means
    # (a script may catch it and go on training); the worker stops when told to or when the main process is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = _connect(argv[1], authkey)
    if conn is None:
        return 1
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
