"""The worker process of the process executor: ``python -m sofx.offload.process_worker ADDRESS``.

Started by :class:`sofx.offload.process_executor.ProcessExecutor` as a fresh
interpreter (not ``multiprocessing``: no re-import of the user's ``__main__``,
so scripts without an ``if __name__ == "__main__"`` guard and notebooks work).
It reads an authentication key from stdin, connects to the unix socket
``ADDRESS``, receives its configuration (file names of the shared tensors,
block layouts, the Adam configuration, the publish buffers -- all JSON-able), maps the shared
tensors and answers ``("ready", pid)``. Then, for every
:class:`~sofx.offload.block_ops.BlockOp` received, it sends back one
:class:`~sofx.offload.block_ops.OpResult`, in order. ``None`` stops it. A
closed connection (the main process died or exited without closing the
optimizer) stops it too, after removing any shared-memory file still named
(the engine unlinks them once this process has mapped them).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import torch

from sofx.offload.block_runner import AdamConfig, BlockRunner
from sofx.offload.blocks import TENSOR_NAMES, BlockLayout, BlockTensors
from sofx.offload.shared_memory import SharedTensorSpec, open_shared_tensor, remove_files

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
    """Receive the configuration, then run operations until told to stop; returns the exit code."""
    config = conn.recv()
    try:
        torch.set_num_threads(int(config.get("num_threads", 1)))
        torch.set_grad_enabled(False)
        runner = build_runner(config)
    except BaseException as exc:  # the main process raises this as a clear startup error
        conn.send(("failed", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            op = conn.recv()
            if op is None:
                return 0
            conn.send(runner.run(op))
        except (EOFError, OSError):
            # The main process died without closing the optimizer (also while an operation ran: its result
            # cannot be sent): nobody else will remove the files.
            remove_files([spec["path"] for spec in config["tensors"].values()])
            return 0


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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(argv[1])
    conn = Connection(sock.detach())
    answer_challenge(conn, authkey)
    deliver_challenge(conn, authkey)
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
