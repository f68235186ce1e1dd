"""How many threads the native CPU kernels use, per context.

By default a native call runs on ``torch.get_num_threads()`` threads of torch's
own OpenMP runtime: its threads are usually spinning for work after torch's
last parallel region, so they take the call's shares at once. They also spin
on after the call (libgomp's default, for a few milliseconds), which costs a
caller that wants the cores back right away, e.g. a thread that steps an
optimizer block while another thread is about to run backward.

Within ``with started_threads(n):`` the calls of the CPU kernels made by
*this* thread (the setting is a :class:`contextvars.ContextVar`: other threads
and other contexts keep their own) run on ``n`` threads started for each call
and joined before it returns (the calling thread is one of them): no thread
runs on afterwards. Starting them costs ~20-50 us per call, so this pays for
blocks of about 2^18 elements and more. A build of the kernels without OpenMP
always starts its threads per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

from sofx.kernels.user_numbers import as_integer

__all__ = ["started_threads", "native_thread_request"]

_STARTED: contextvars.ContextVar[int] = contextvars.ContextVar("sofx_started_threads", default=0)


@contextlib.contextmanager
def started_threads(n: int) -> Iterator[None]:
    """Run this context's native CPU kernel calls on ``n >= 1`` threads started (and joined) per call (a numpy
    integer or a 1-element integer tensor too, read as a Python int)."""
    count = as_integer(n)
    if count is None or count < 1:
        raise ValueError(f"started_threads: expected an int >= 1, got {n!r}")
    token = _STARTED.set(count)
    try:
        yield
    finally:
        _STARTED.reset(token)


def native_thread_request() -> int:
    """The ``nthreads`` argument of the C entry: ``-n`` inside :func:`started_threads` (``n`` threads started
    per call), else ``torch.get_num_threads()`` (torch's OpenMP threads)."""
    n = _STARTED.get()
    return -n if n else torch.get_num_threads()
