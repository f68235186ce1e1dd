"""The offload engine: fp32 master blocks on the CPU, Adam steps speculated during backward.

:class:`OffloadEngine` binds to a list of param groups and drives one training
step at a time (SPECULATION.md sections 3 and 5):

1. **Backward.** A post-accumulate-grad hook per parameter moves the
   gradient out of ``param.grad`` into its block's fp32 gradient buffer
   (summing micro-steps). When a block is *ready* (every expected parameter
   has its final gradient) the engine asks the speculation layer
   (:func:`sofx.speculate.on_block_ready`: early veto, eligibility, adaptive
   policy) and, if it says so, submits the block's speculative Adam step to
   the executor -- while backward goes on with earlier layers. With an
   in-process executor (inline, thread) the main thread only submits a
   ``"ready"`` operation: the executor takes the block's sum of squares and
   asks the speculation layer itself, in arrival order (the same calls with
   the same values, off the thread that runs backward); a late gradient waits
   for those decisions first. The process executor's worker cannot reach the
   engine's state, so there the main thread decides.
2. **step().** Wait for the executor, hand the per-block sums of squares to
   :func:`sofx.speculate.plan_validation` (overflow, loss scale, global norm,
   clipping, changed hparams), carry its per-block actions out (commit,
   undo+redo, undo, step late, skip) in the executor, and give the model's
   parameters the new masters of every stepped block (cast to their dtype).

**Publishing without a copy in step()** (``swap_params``, CPU models): each
parameter gets two buffers of its own dtype (the first is its original
storage). The executor, as it steps a block, writes the block's new masters
into the buffer the model is *not* using -- during backward, off the main
thread; in the same pass as the step where the block is stepped one leaf per
parameter (in-process executors: the kernels' ``p_copy``), after it otherwise
-- and ``step()`` only points the parameter at that buffer
(``param.data = buffer``, bumping its version counter as an in-place update
would). Until ``step()`` the model keeps its old values (a forward between
backward and ``step()`` sees them, as with ``torch.optim``). A parameter's
storage alternates between its two buffers, so a reference to ``param.data``
taken earlier goes stale (read ``param`` itself). Parameters that are views
of a larger storage, share storage with another parameter, are already in
shared memory or are tensor subclasses are copied in ``step()`` as before;
so is everything when ``swap_params=False``, and a parameter whose strides
changed since (``model.to(memory_format=torch.channels_last)`` after creating
the optimizer): it keeps its new layout, as ``torch.optim``'s in-place update
keeps it. With the process executor the
buffers live in shared memory (the model's parameters then do too, until
``close()`` moves them back to private memory).

The engine decides nothing about Adam, clipping or loss scaling itself: it
moves gradients, counts arrivals, and carries decisions out. Device blocks
(``n_device_blocks``, partial offload) live on the model's device and are
stepped in ``step()`` by the device's backend, with the same actions.

Under ``DistributedDataParallel`` (``ddp``) the gradients of the parameters
it averages come from its communication hook instead of the gradient hooks
(:mod:`sofx.offload.ddp`), each as its bucket's all-reduce completes.

Executors: ``"inline"``, ``"thread"``, ``"process"`` (worker process on
shared-memory tensors; falls back to ``"thread"`` with a warning when
``/dev/shm`` cannot hold the state, or when reserving it fails after the
space check: then what was reserved is released first -- files closed,
parameters moved back to private memory -- and no worker is started).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import dataclasses
import functools
import itertools
import math
import numbers
import os
import threading
import time
from collections import Counter, deque
import warnings
import weakref
from dataclasses import fields
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from sofx.adam import COUNT_MAX, AdamHParams, check_float32_range, check_step_size
from sofx.errors import HParamError, LeafError, SofxError, StructureError, UnsupportedError
from sofx.kernels import select_backend
from sofx.kernels.user_numbers import _described, as_integer, flag, is_bool, real_number
from sofx.kernels.grad_copy import copy_with_sumsq
from sofx.kernels.storage import in_storage, refuse_short_storage, short_storage_message, storage_shortfall
from sofx.loss_scale import LossScaler, call_rule
from sofx.offload.arena import LocalArena
from sofx.offload.arrivals import ArrivalTracker
from sofx.offload.backward_passes import BackwardPasses
from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.block_runner import AdamConfig, BlockRunner, combined_eligibility, uses_flat_layout
from sofx.offload.snapshot_needs import SnapshotNeeds
from sofx.offload.ddp import (CONTENT_KEYS, USED_HPARAMS, DDPRoute, Decision, ReplicaWatch, check_replicas, ddp_route,
                              reduced_indices, refuse_averaged, unmatched_step_error)
from sofx.offload.blocks import (
    BlockLayout,
    BlockTensors,
    allocate_block_tensors,
    block_nbytes,
    check_params,
    plan_blocks,
)
from sofx.offload.engine_state import (STATE_FORMAT, check_dense, check_nonnegative, engine_state_dict,
                                      hparams_text, load_engine_state, replica_entries)
from sofx.offload.executor import (
    Executor,
    ExecutorError,
    ExecutorTimeout,
    block_number,
    failure_message,
    raise_failures,
)
from sofx.offload.grad_hooks import GradHooks
from sofx.offload.inline_executor import InlineExecutor
from sofx.offload.interrupts import NO_GATE, acquire_gate, release_gate, section_breaks, without_grad
from sofx.offload.shared_memory import DEFAULT_SHM_DIR, SharedMemoryArena, shm_budget
from sofx.offload.step_events import EngineStepReport
from sofx.offload.thread_executor import ThreadExecutor
from sofx.speculate import (
    BackwardTally,
    BlockAction,
    PolicyState,
    SpeculationConfig,
    StepContext,
    StepReport,
    ValidationPlan,
    begin_step,
    grad_sumsq,
    on_block_ready,
    on_late_gradient,
    on_speculation_held,
    on_speculation_refused,
    plan_validation,
)
from sofx.stored_values import refuse_beyond
from sofx.transforms import total_sumsq
from sofx.tree import article
from sofx.warn import caller_stacklevel

__all__ = ["OffloadEngine", "EngineStepReport", "EXECUTORS", "STATE_FORMAT"]

EXECUTORS = ("inline", "thread", "process")

#: In-process executors borrow autograd's gradients (no copy into the block's buffer) for the blocks whose
#: parameters hold at least this many elements on average. Below it copying is cheaper: a block of borrowed
#: gradients is stepped one Adam leaf per parameter (~20 us of host work each), a copied one as one flat leaf
#: (the copy takes the sum of squares in the same pass). Measured crossover on CPU about 64K elements
#: (benchmarks/RESULTS.md, "Borrowing only large gradients").
BORROW_MIN_NUMEL = 1 << 16

HParamsFn = Callable[[], Sequence[AdamHParams]]

#: An error about a block names its first this many parameters (:func:`describe_block`).
NAMED_PARAMS = 4

#: At interpreter exit, how long (at most: the engine's ``timeout`` where shorter) the close waits for a call or
#: gradient hook still running in another thread -- a daemon thread: the exit handlers run beside those -- before it
#: closes the engine under it (:meth:`OffloadEngine._close_for_exit`).
EXIT_WAIT_S = 5.0

#: The keys of a parameter's torch.optim-style state (:meth:`OffloadEngine.param_state`), in order.
PARAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")

# OffloadEngine._kept_state where close() dropped the state (keep_state=False: interpreter exit, collection)
_STATE_DROPPED = "dropped"
# ... where it closed the engine between backward and step()
_STATE_MID_STEP = "closed between backward and step()"


def _check_timeout(timeout: Any) -> float:
    """``timeout`` as a Python float of seconds in ``(0, threading.TIMEOUT_MAX]`` (a numpy number or a 1-element
    tensor too); a bool is refused, and so is more than the threads' waits take (an inf timeout was taken and
    the first wait raised an OverflowError)."""
    t = real_number(timeout, "timeout", UnsupportedError)
    if not (isinstance(t, numbers.Real) and not is_bool(t) and 0 < t <= threading.TIMEOUT_MAX):
        raise UnsupportedError(f"timeout must be a number of seconds > 0 and at most threading.TIMEOUT_MAX = "
                               f"{threading.TIMEOUT_MAX:g}, got {timeout!r}")
    return float(t)


def param_path(group_starts: Sequence[int], group: int, i: int) -> str:
    """Parameter ``i`` of param group ``group`` as the user passed it: ``param_groups[group]['params'][k]``, ``k`` its
    index in the group (``group_starts[g]``: group ``g``'s first parameter index)."""
    return f"param_groups[{group}]['params'][{i - group_starts[group]}]"


def describe_block(layouts: Sequence[BlockLayout], group_starts: Sequence[int], b: int) -> str:
    """Block ``b`` of ``layouts`` for an error message, named by its parameters as the engine's other errors name
    them: index, ``param_groups[g]['params'][k]`` (:func:`param_path`) and shape, the first :data:`NAMED_PARAMS` of
    them (-1: every block)."""
    if not 0 <= b < len(layouts):
        return block_number(b)
    layout = layouts[b]
    named = [f"parameter {i} = {param_path(group_starts, layout.group, i)}, shape {tuple(shape)}"
             for i, shape in zip(layout.param_indices[:NAMED_PARAMS], layout.shapes)]
    more = len(layout.param_indices) - NAMED_PARAMS
    return f"block {b} ({'; '.join(named)}{f'; and {more} more' if more > 0 else ''})"


def _whole_number(value: Any, largest: int, name: str, error: type[Exception]) -> int | None:
    """``value`` as a Python int where it is a whole number in ``[0, largest]`` (a float as torch.optim keeps its
    step, a numpy number, a 1-element tensor), else None (an inf or nan float, whose ``int()`` raised); a tensor
    outside its storage (freed or shrunk) is refused, ``error`` naming it ``name``."""
    x = real_number(value, name, error)
    if isinstance(x, numbers.Real) and not is_bool(x) and not isinstance(x, numbers.Integral):
        x = float(x)
        x = int(x) if math.isfinite(x) and x.is_integer() else None
    return int(x) if isinstance(x, numbers.Integral) and not is_bool(x) and 0 <= x <= largest else None


class OffloadEngine:
    """Speculative offloaded Adam over ``groups`` of parameters; see the module docstring.

    ``hparams_fn()`` returns the current :class:`~sofx.AdamHParams` of every
    group (complete, Python floats); it is read when a step's first block is
    ready and again at validation. ``adam``: the static Adam configuration;
    ``speculation``: clipping, profile, missing gradients, snapshot budget,
    adaptive policy, on/off; ``scaler``: the loss-scale rule; ``ddp``: the
    ``DistributedDataParallel`` module averaging the gradients of (some of) the
    parameters, or ``None``.
    """

    @without_grad  # (its copies into parameters: torch.no_grad() blocks, which a Ctrl-C can leave off)
    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], hparams_fn: HParamsFn, *,
                 adam: AdamConfig, speculation: SpeculationConfig, scaler: LossScaler,
                 executor: str = "thread", block_numel: int = 2 ** 22, n_device_blocks: int = 0,
                 gradient_accumulation_steps: int = 1, timeout: float = 60.0, num_threads: int = 1,
                 shm_dir: str = DEFAULT_SHM_DIR, shm_limit_bytes: int | None = None,
                 swap_params: bool = True, ddp: Any = None) -> None:
        if executor not in EXECUTORS:
            raise UnsupportedError(f"executor={executor!r}; expected one of {EXECUTORS}")
        timeout = _check_timeout(timeout)
        threads = as_integer(num_threads)  # numpy's and 1-element integer tensors too, as a Python int
        if threads is None or threads < 1:
            # (the process executor's worker refused it only once started, after the parameters had moved)
            raise UnsupportedError(f"num_threads must be an integer >= 1 (the process executor's worker threads), "
                                   f"got {num_threads!r}")
        num_threads = threads
        limit = None if shm_limit_bytes is None else as_integer(shm_limit_bytes)
        if shm_limit_bytes is not None and (limit is None or limit < 0):
            raise UnsupportedError(f"shm_limit_bytes must be None or an integer >= 0, got {shm_limit_bytes!r}")
        shm_limit_bytes = limit
        if not isinstance(shm_dir, (str, os.PathLike)):  # (None raised shutil's TypeError under "process")
            raise UnsupportedError(f"shm_dir must be a directory path (a str or os.PathLike; the default is "
                                   f"{DEFAULT_SHM_DIR!r}), got {shm_dir!r:.80}")
        swap_params = flag("swap_params", swap_params, UnsupportedError)  # ("no" was taken as on)
        self.device = check_params(groups)
        self.params: list[torch.Tensor] = [p for g in groups for p in g]
        #: The indices of the parameters whose gradients ``ddp`` averages (taken from its communication hook, not
        #: from gradient hooks: see :mod:`sofx.offload.ddp`).
        self.reduced: frozenset[int] = frozenset() if ddp is None else reduced_indices(ddp, self.params)
        if ddp is None:
            refuse_averaged(self.params)  # (before anything is made: see sofx.offload.ddp)
        # (registered now, before anything else is made: a DDP module with a hook of its own is refused first)
        self._route: DDPRoute | None = None if ddp is None else ddp_route(ddp)
        # Why this engine cannot step (a DDP module averaging its parameters' gradients was found at the first
        # backward), or None; and whether that first backward's check is still to come (without ddp).
        self._refusal: UnsupportedError | None = None
        self._check_averaged = ddp is None
        # Under ddp: what of this rank's state changed since the ranks compared theirs, and whether they compare
        # them at this step (decided together at each synchronized backward; see _check_replicas)
        self._replicas: ReplicaWatch | None = None if self._route is None else ReplicaWatch(self._route)
        self.hparams_fn = hparams_fn
        self.adam_config = adam
        self.adam = adam.build()
        self.speculation = speculation
        self.scaler = scaler
        self.scaler_state = call_rule(scaler, "init", where="OffloadEngine: ", after="the engine is not made")
        self.policy_state: PolicyState = speculation.policy.init()
        self.timeout = timeout
        self.layouts = plan_blocks(groups, block_numel, n_device_blocks)
        self._group_starts = list(itertools.accumulate((len(g) for g in groups[:-1]), initial=0))  # (param_path)
        # Names block b by its parameters in errors (the executors hold it: no reference to the engine).
        self.describe_block: Callable[[int], str] = functools.partial(describe_block, self.layouts,
                                                                      self._group_starts)
        self._check_backend(getattr(torch, adam.state_dtype))
        self.n_groups = len(groups)
        self.tracker = ArrivalTracker(self.layouts, gradient_accumulation_steps)
        # The backward calls that gave this step gradients (micro_steps)
        self.passes = BackwardPasses()
        self.iteration = 0
        self._seq = itertools.count()
        self._failed: BaseException | None = None
        self._reduced_error: Exception | None = None  # what take_reduced_gradient refused in this backward
        # Per averaged parameter: the .grad DDP left at the end of the step's last synchronized backward (see
        # _grad_mark), for step() to see a change made to it since
        self._reduced_grads: dict[int, tuple[weakref.ReferenceType, int, int] | None] = {}
        self._closed = False
        self._close_unfinished = False  # a close() was broken into before its executor closed (see _close)
        # Set by close(): why the state it kept is not whole (operations it left unfinished), or that it dropped the
        # state (the interpreter's exit, collection: keep_state=False); None: the state kept is the last step's.
        self._kept_state: str | None = None
        # The process that made the engine (a child forked from it has another id: see _forked_message)
        self._pid = os.getpid()
        self._hook_lock = threading.Lock()  # autograd runs hooks of different devices on different threads
        self._call_lock = threading.Lock()  # step(), zero_grad() and the state calls: one at a time (_exclusive)
        # The thread holding _call_lock (in _exclusive or close()) / running a gradient hook's section, else None; a
        # close() on that very thread (a signal handler) is deferred to the end of that call (_close_pending).
        self._call_owner: int | None = None
        self._hook_owner: int | None = None
        self._call_what: str | None = None  # the call holding _call_lock (for the exit's warning)
        self._closing = False  # close() waits for another thread's call or hook to end
        # The call a close() was called inside on its thread (a signal handler's), deferred to that call's end; ""
        # none. One a second Ctrl-C kept from being carried out there is carried out by the next call or gradient
        # hook (_deferred_close_dropped).
        self._close_pending = ""
        self._turn_cond = threading.Condition()  # orders the decisions taken in the executor
        self._tickets = self._turn = 0

        state_dtype = getattr(torch, adam.state_dtype)
        cpu_layouts = [b for b in self.layouts if not b.on_device]
        device_layouts = [b for b in self.layouts if b.on_device]
        local_swappable = self._swappable_params() if swap_params and self.device.type == "cpu" else set()
        swappable = local_swappable
        if executor == "process" and cpu_layouts:
            need = sum(block_nbytes(b, state_dtype) for b in cpu_layouts)
            budget = shm_budget(shm_dir, shm_limit_bytes)
            publish_bytes = sum(2 * self.params[i].numel() * self.params[i].element_size()
                                for b in cpu_layouts for i in b.param_indices if i in swappable)
            if need + publish_bytes > budget:
                swappable = set()  # the publish buffers do not fit: copy in step() instead
            why = None
            if not os.path.isdir(shm_dir):  # (its budget is 0: the warning said to enlarge it)
                what = "it does not exist" if not os.path.exists(shm_dir) else "it is a file"
                why = (f"for the optimizer state, but shm_dir {os.fspath(shm_dir)!r} is not a directory ({what}); "
                       f"falling back to the thread executor. Pass an existing directory as shm_dir (the default is "
                       f"{DEFAULT_SHM_DIR!r})")
            elif need > budget:
                # (the binding limit: the caller's shm_limit_bytes, or the directory's free space)
                limited = shm_limit_bytes is not None and budget == int(shm_limit_bytes)
                remedy = ("Raise shm_limit_bytes" if limited else
                          f"Enlarge {shm_dir} (e.g. docker --shm-size for /dev/shm) or pass another shm_dir")
                why = (f"in {shm_dir} for the optimizer state, but only {budget:,} bytes ({budget / 2**20:.1f} MiB) "
                       f"are available{' (shm_limit_bytes)' if limited else ''}; falling back to the thread "
                       f"executor. {remedy}")
            if why is not None:
                warnings.warn(f"sofx.offload: the process executor needs {need:,} bytes ({need / 2**20:.1f} MiB) of "
                              f"shared memory {why} to use the process executor.",
                              RuntimeWarning, stacklevel=caller_stacklevel())
                executor, swappable = "thread", local_swappable
        self._interrupts: Any = NO_GATE
        self._cpu_arena = SharedMemoryArena(shm_dir) if executor == "process" and cpu_layouts else LocalArena("cpu")
        self._shared_params: list[int] = []  # parameters whose storage is a shared-memory publish buffer
        device_arena = LocalArena(self.device)
        self.tensors: dict[int, BlockTensors] = {}
        try:
            # Ctrl-C is held back in the sections that change the engine's state whole (sofx.offload.interrupts).
            self._interrupts = acquire_gate()
            try:
                self._reserve_cpu_blocks(cpu_layouts, state_dtype, swappable)
            except (OSError, RuntimeError) as exc:
                # The space check passed, but reserving or mapping the shared memory failed (another process
                # took the space since, a mapping limit, ...): give back what was reserved, use the thread executor.
                if executor != "process":
                    raise
                self._release_shared_memory()
                self.tensors.clear()
                warnings.warn(f"sofx.offload: reserving shared memory in {shm_dir} for the process executor failed "
                              f"({type(exc).__name__}: {exc}); falling back to the thread executor",
                              RuntimeWarning, stacklevel=caller_stacklevel())
                self._cpu_arena, executor = LocalArena("cpu"), "thread"
                self._reserve_cpu_blocks(cpu_layouts, state_dtype, local_swappable)
            self.executor_name = executor
            for b in device_layouts:
                self.tensors[b.index] = allocate_block_tensors(b, device_arena.allocate, state_dtype)
            self._load_masters_from_model()
            self.device_runner = BlockRunner(self.adam, device_layouts,
                                             {b.index: self.tensors[b.index] for b in device_layouts})
            self.executor = self._make_executor(executor, cpu_layouts, num_threads)
            # Both processes have mapped the shared tensors now: the descriptors of their files (which never had
            # a name, so nothing is left in /dev/shm however the processes end, also while the worker starts) are
            # not needed any more; the memory is released when the last mapping goes.
            self._cpu_arena.close()
        except BaseException:
            self._undo_construction()
            raise
        try:  # (a Ctrl-C here -- the hooks of many parameters take a while -- left the worker running for good)
            # In-process blocks of large parameters borrow autograd's fp32 gradients instead of copying them into
            # the buffer (see BORROW_MIN_NUMEL).
            self._borrowing = [layout.on_device or (self.executor_name != "process"
                                                    and layout.numel >= BORROW_MIN_NUMEL * len(layout.numels))
                               for layout in self.layouts]
            # In-process executors decide on speculation in the executor (see the module docstring).
            self._deferred = self.executor_name != "process"
            self._stale_grads: list | None = None
            # Per block: (key, Eligibility) of the last finite-gradient eligibility decision (see _eligibility).
            self._eligibility_memo: list[tuple[tuple, Any] | None] = [None] * len(self.layouts)
            # Per block: the snapshot bytes its last speculative steps held or needed (see snapshot_needs).
            self._snapshot_needs = SnapshotNeeds(len(self.layouts))
            # Per parameter: it has had a gradient since the last zero_grad(set_to_none=True) / it holds a zeroed
            # one, as torch's .grad would after zero_grad(set_to_none=False) (see discard_gradients).
            self._had_grad = [False] * len(self.params)
            self._zero_grads = [False] * len(self.params)
            self._param_kinds = [(p.dtype, p.shape, p.device) for p in self.params]  # what the optimizer was made for
            # Per block, per slot: where its parameter's gradient goes in the block's buffer (made once: ~1 us a hook).
            self._grad_views = [tuple(self.tensors[layout.index].views(self.tensors[layout.index].grad, layout))
                                for layout in self.layouts]
            # Last, as nothing can be refused any more: the hooks take the parameters over from an older optimizer,
            # which then refuses to step for good (a constructor that raised after that broke it).
            self.hooks = GradHooks(self.params, self._on_grad, unhooked=self.reduced,
                                   on_superseded=self._move_params_out_of_shared_memory)
            if self._route is not None:
                self._route.bind(self, {id(self.params[i]): i for i in self.reduced})
            self._reset_step()
            self._note_versions()
            # Closed before the interpreter finalizes if the script did not: daemon threads cannot run after it (the
            # process executor's stop message was never sent, and close() waited 10 s to kill the worker; a thread
            # executor's worker inside a kernel could abort the exit). The registry holds a weak reference.
            self._close_at_exit = functools.partial(_close_if_alive, weakref.ref(self))
            atexit.register(self._close_at_exit)
        except BaseException:
            self._undo_construction()
            raise

    # ------------------------------------------------------------ setup
    def _undo_construction(self) -> None:
        """Where the constructor raises (a refusal, a failed start, a Ctrl-C): remove the hooks it registered, stop
        the executor it started, release the shared memory and the interrupt gate; the engine is closed (its
        ``__del__`` does nothing: it released the gate again, another engine's)."""
        self._closed = True
        try:
            if "hooks" in self.__dict__:
                self.hooks.remove()
                if self._route is not None:
                    self._route.unbind(self)
            if "executor" in self.__dict__:
                self.executor.close()
        finally:
            try:
                self._release_shared_memory()
            finally:
                release_gate(self._interrupts)
                self._interrupts = NO_GATE

    def _check_backend(self, state_dtype: torch.dtype) -> None:
        """Refuse now a backend that cannot step some block (the CPU blocks' or the device blocks' fp32 masters
        and ``state_dtype`` moments), naming the block's first parameter: the executor would fail at the first
        step, and the engine for good."""
        checked = set()
        for layout in self.layouts:
            device = self.device if layout.on_device else torch.device("cpu")
            if device in checked:
                continue
            checked.add(device)
            try:
                select_backend(self.adam_config.backend, device, torch.float32, state_dtype)
            except UnsupportedError as exc:
                first = param_path(self._group_starts, layout.group, layout.param_indices[0])
                raise UnsupportedError(f"{first} (block {layout.index}, stepped on {device} as fp32 masters): "
                                       f"{exc}") from None

    def _make_executor(self, name: str, cpu_layouts: list[BlockLayout], num_threads: int) -> Executor:
        """The executor ``name`` over the CPU blocks; the process executor without any (every block on the device:
        no shared memory reserved, nothing for a worker to step) starts no worker process: an inline executor runs
        its operations (the steps' ends), ``executor_name`` stays "process"."""
        cpu_tensors = {b.index: self.tensors[b.index] for b in cpu_layouts}
        if name == "inline" or (name == "process" and not cpu_layouts):
            return InlineExecutor(BlockRunner(self.adam, cpu_layouts, cpu_tensors, self._pub), self.describe_block)
        if name == "thread":
            return ThreadExecutor(BlockRunner(self.adam, cpu_layouts, cpu_tensors, self._pub), self._interrupts,
                                  close_timeout=self.timeout, describe=self.describe_block)
        from sofx.offload.process_executor import ProcessExecutor

        config = {
            "layouts": [b.to_json() for b in cpu_layouts],
            "tensors": {name: spec.to_json() for name, spec in getattr(self._cpu_arena, "specs", {}).items()},
            "adam": self.adam_config.to_json(),
            "num_threads": num_threads,
            "publish": self._pub_names,
            "fds": list(self._cpu_arena.fds),  # (the worker closes them once it has mapped the tensors)
        }
        return ProcessExecutor(config, startup_timeout=max(self.timeout, 120.0), interrupts=self._interrupts,
                               pass_fds=self._cpu_arena.fds, describe=self.describe_block, close_timeout=self.timeout)

    def _reserve_cpu_blocks(self, cpu_layouts: Sequence[BlockLayout], state_dtype: torch.dtype,
                            swappable: set[int]) -> None:
        """Allocate the CPU blocks' tensors and publish buffers in ``self._cpu_arena``."""
        for b in cpu_layouts:
            self.tensors[b.index] = allocate_block_tensors(b, self._cpu_arena.allocate, state_dtype)
        self._setup_publish(cpu_layouts, swappable)

    def _release_shared_memory(self) -> None:
        """Move the parameters that live in this engine's shared-memory publish buffers back to private memory,
        then close the arena's files (idempotent; the values are kept)."""
        try:
            self._move_params_out_of_shared_memory()
        finally:
            self._cpu_arena.close()

    def _move_params_out_of_shared_memory(self) -> None:
        """Move the parameters that still live in this engine's shared-memory publish buffers to private memory
        (the values kept; idempotent); one that lives elsewhere now (``p.data = t``) is left where it is. Also
        called when an optimizer created again over the parameters supersedes this one, during its constructor:
        moved later (this one closed or collected between the new one's backward and ``step()``), the new one
        saw its parameters changed in place."""
        with torch.no_grad():
            for i in self._shared_params:
                p = self.params[i]
                if p.data_ptr() in {t.data_ptr() for t in self._pub_shaped.get(i, ())}:
                    p.data = p.detach().clone()
        self._shared_params.clear()

    def _load_masters_from_model(self) -> None:
        """Copy the model's parameter values into the fp32 masters."""
        with torch.no_grad():
            for layout in self.layouts:
                t = self.tensors[layout.index]
                for view, i in zip(t.views(t.master, layout), layout.param_indices):
                    view.copy_(self.params[i].detach().reshape(-1))

    def _note_versions(self) -> None:
        """Remember every parameter's version counter and storage: what the model holds now is what the masters
        hold."""
        self._versions = [(p._version, p.data_ptr()) for p in self.params]

    def _edited_params(self) -> list[int]:
        """The parameters changed since :meth:`_note_versions`: in place through autograd's view of them
        (``p.clamp_()``, ``p.copy_()`` under ``no_grad``, ``model.load_state_dict()``), or given other storage
        (``p.data = t``, ``model.to()``); a write into ``p.data`` in place is not seen."""
        return [i for i, (p, v) in enumerate(zip(self.params, self._versions)) if (p._version, p.data_ptr()) != v]

    def _adopt_model_edits(self) -> None:
        """Take parameters changed in place since the last step (weight clipping, a projection, a reloaded
        layer) as their new masters, as ``torch.optim`` steps from whatever the parameter holds."""
        edited = self._edited_params()
        if edited:
            self._take_params_as_masters(edited)

    def _take_params_as_masters(self, indices: Sequence[int]) -> None:
        """The model's values of parameters ``indices`` as their masters (between steps), then
        :meth:`_note_versions`. A bf16/fp16 parameter holds its master rounded: the elements it holds at that
        value keep their master (weight clipping that clips nothing, ``model.load_state_dict()`` of the weights
        the model holds after the optimizer's state was loaded); taking them all lost the fp32 precision. A
        parameter whose storage no longer holds it (freed with ``untyped_storage().resize_(0)``, as FSDP frees a
        resharded parameter: :func:`~sofx.kernels.storage.storage_shortfall`) is refused; copying it read address
        0."""
        for i in indices:  # all checked before any is taken
            p, (dtype, shape, device) = self.params[i], self._param_kinds[i]
            if (p.dtype, p.shape, p.device) != (dtype, shape, device):
                raise LeafError(f"parameter {i} is now {tuple(p.shape)} {p.dtype} on {p.device}, the optimizer was "
                                f"made for {tuple(shape)} {dtype} on {device} (model.to(), model.half(), p.data = "
                                "a tensor of another kind): its masters and buffers are of that kind; create the "
                                "optimizer after converting or moving the model")
            refuse_short_storage(p, lambda: self._describe_param(i))
        with torch.no_grad():
            for i in indices:  # (between steps)
                master, p = self._param_views(i)["master"], self.params[i].detach()
                if p.dtype == master.dtype:
                    master.copy_(p)
                else:
                    master.copy_(torch.where(p != master.to(p.dtype), p.to(master.dtype), master))
        self._note_versions()

    def _swappable_params(self) -> set[int]:
        """Indices of the parameters whose storage may alternate between two publish buffers: plain
        contiguous CPU tensors that own their whole storage alone and are not in shared memory."""
        def key(p: torch.Tensor) -> int:
            return p.untyped_storage().data_ptr()

        owners = Counter(key(p) for p in self.params if p.layout == torch.strided and p.numel() > 0)
        out = set()
        for i, p in enumerate(self.params):
            if (type(p) in (torch.nn.Parameter, torch.Tensor) and p.device.type == "cpu"
                    and p.layout == torch.strided and p.numel() > 0 and p.is_contiguous()
                    and p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()
                    and owners[key(p)] == 1 and not p.is_shared()):
                out.add(i)
        return out

    def _setup_publish(self, cpu_layouts: Sequence[BlockLayout], swappable: set[int]) -> None:
        """The two publish buffers of every swappable parameter of the CPU blocks (see the module docstring)."""
        # block -> per parameter: [buffer 0, buffer 1] (1-d, the parameter's dtype) or None
        self._pub: dict[int, list[list[torch.Tensor] | None]] = {}
        self._pub_names: dict[int, list[list[str] | None]] = {}  # the same, as shared-tensor names
        self._cur = [0] * len(self.params)  # which buffer each parameter uses now
        self._pub_shaped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter -> the pair, its shape
        self._published: list[tuple[int, ...] | None] = [None] * len(self.layouts)
        shared = isinstance(self._cpu_arena, SharedMemoryArena)
        for layout in cpu_layouts:
            slots: list[list[torch.Tensor] | None] = []
            names: list[list[str] | None] = []
            for slot, i in enumerate(layout.param_indices):
                p = self.params[i]
                if i not in swappable:
                    slots.append(None)
                    names.append(None)
                    continue
                if shared:
                    pair = [layout.tensor_name(f"pub{slot}.{k}") for k in (0, 1)]
                    bufs = [self._cpu_arena.allocate(name, p.numel(), p.dtype) for name in pair]
                    with torch.no_grad():
                        bufs[0].copy_(p.detach().reshape(-1))
                        p.data = bufs[0].view(p.shape)
                    self._shared_params.append(i)
                    names.append(pair)
                else:
                    # .data, not detach(): writes into a buffer must not bump the parameter's version counter
                    bufs = [p.data.view(-1), torch.empty(p.numel(), dtype=p.dtype)]
                    names.append(None)
                slots.append(bufs)
                self._pub_shaped[i] = (bufs[0].view(p.shape), bufs[1].view(p.shape))
            if any(x is not None for x in slots):
                self._pub[layout.index] = slots
                self._pub_names[layout.index] = names

    def _publish_mask(self, b: int, present: Sequence[bool]) -> tuple[int, ...] | None:
        """Which publish buffer an operation stepping block ``b`` writes, per parameter (-1: none)."""
        slots = self._pub.get(b)
        if slots is None:
            return None
        mask = tuple(1 - self._cur[i] if bufs is not None and has else -1
                     for bufs, i, has in zip(slots, self.layouts[b].param_indices, present))
        return None if all(k < 0 for k in mask) else mask

    def set_speculation(self, enabled: bool) -> None:
        """Speculate blocks during backward (``enabled``) or step every block in ``step()``; settable between steps.
        The setting changes a step's bits (a block speculated and redone is the serial step within float32
        rounding), so under ``ddp`` a change makes the ranks compare their settings at the next step (see
        :func:`~sofx.offload.engine_state.settings_text`): set on one rank alone, that step is refused on every
        rank, naming each rank's setting; set the same on every rank, it steps on. Refused on a closed engine (or
        one that cannot step: :meth:`_check_usable`), as its other calls are."""
        self._check_usable()
        if enabled == self.speculation.enabled:
            return
        with self._interrupts:  # (a Ctrl-C between the two left the setting changed and the ranks not told)
            self.speculation = dataclasses.replace(self.speculation, enabled=enabled)
            self._state_changed()

    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def reload_params(self) -> None:
        """Take the model's current parameter values as the new masters (after loading model weights)."""
        self._check_usable()
        with self._exclusive("reload_params()"):
            self._check_state_change("reload_params()")
            self._wait_all()
            self._take_params_as_masters(range(len(self.params)))
            self._state_changed(("master",))

    def _state_changed(self, contents: Sequence[str] = ()) -> None:
        """A call changed the state (``contents``: the keys whose values it changed; the step counts are always
        compared): under ``ddp`` the ranks compare their states at the next step (:meth:`_check_replicas`)."""
        if self._replicas is not None:
            self._replicas.changed(contents)

    def _check_between_steps(self, what: str) -> None:
        if self.in_step:
            raise SofxError(f"{what} was called between backward and step(): this step's gradients are held and "
                            "blocks may hold speculative steps of the current masters; call step() or zero_grad() "
                            "first")

    def _check_state_change(self, what: str) -> None:
        """:meth:`_check_between_steps` for a call that changes the state; under ``ddp`` also refused after the
        ranks' exchange of a step at its synchronized backward (where that backward gave this optimizer no
        gradient: it holds none): they compared their states there, and ``step()`` compares nothing, so the
        change would be stepped unseen by the others."""
        self._check_between_steps(what)
        if self._replicas is not None and self._replicas.decision is not None:
            raise SofxError(f"{what} was called between a synchronized backward and step(): under ddp the ranks "
                            "compared their optimizer states at that backward and step() compares nothing (it "
                            "enters no collective), so the change would be stepped unseen by the other ranks; call "
                            "step() or zero_grad() first")

    # ------------------------------------------------------------ step state
    def _reset_step(self) -> None:
        self.tracker.reset([p.requires_grad for p in self.params])
        self.passes.reset()
        if self._replicas is not None:
            self._replicas.forget_step()
        self.hooks.refresh()
        self._ctx: StepContext | None = None
        self._tally: BackwardTally | None = None
        self._reduced_grads = {}
        self._speculated = [False] * len(self.layouts)
        self._held: dict[int, str] = {}  # blocks ready during backward held from speculating: why (_block_ready)
        # (block, why, bytes) of speculative steps taken back (the bytes they needed), or holding snapshots (why
        # None: the bytes they hold), not yet in the tally: appended by _record (the main thread), taken by _decide
        # (where the executor decides) and step() (thread-safe appends and pops)
        self._snapshot_reports: deque[tuple[int, str | None, int]] = deque()
        self._refused_bytes: dict[int, int] = {}  # this step's refused blocks: the bytes each needed
        self._planned_bytes: dict[int, int] = {}  # this step's eligible blocks: the bytes their strategies planned
        self._events: list[tuple[str, int]] = []
        self._tickets = self._turn = 0  # nothing is pending: every "ready" operation of the last step ran
        # Per block and parameter: this step's gradient (borrowed from autograd, or a buffer slice).
        self._grads: list[list[torch.Tensor | None]] = [[None] * len(b.numels) for b in self.layouts]
        # ... and the sum of squares of a buffer slice, where it was taken while copying the gradient in.
        self._slot_sumsq: list[list[float | None]] = [[None] * len(b.numels) for b in self.layouts]
        if hasattr(self, "_published"):
            self._published = [None] * len(self.layouts)

    @property
    def loss_scale(self) -> float:
        """The loss scale the next backward must use (1.0 without loss scaling)."""
        return float(self.scaler.scale(self.scaler_state))

    def block_hparams(self) -> list[AdamHParams]:
        """The current hparams of every block (from its param group)."""
        groups = list(self.hparams_fn())
        if len(groups) != self.n_groups:
            raise StructureError(f"hparams_fn returned {len(groups)} groups, the engine has {self.n_groups}")
        return [groups[layout.group] for layout in self.layouts]

    def _begin(self) -> None:
        if self._ctx is None:
            self._ctx, self._tally = begin_step(self.adam, self.speculation, self.scaler, self.scaler_state,
                                                self.policy_state, n_blocks=len(self.layouts),
                                                hparams=self.block_hparams(), backward_scale=self.loss_scale,
                                                stepped=self._may_step())

    def _may_step(self) -> list[bool]:
        """Per block: whether this step may step it, so that its hparams are read (:func:`begin_step`'s
        ``stepped``): a parameter of it is expected to get a gradient (it requires grad: stepped with a zero one
        under ``missing_grad="zero"`` where none comes), has one (set by hand on a frozen parameter, taken at
        ``step()``), or keeps the zero one ``zero_grad(set_to_none=False)`` left (:meth:`_stepped`). A block of
        frozen parameters without any is not stepped: its hparams (a frozen group's lr a scheduler set out of
        range) veto no other block's speculation."""
        return [any(self.tracker.expected[i] or self.tracker.arrivals[i] > 0 or self._zero_grads[i]
                    or self.params[i].grad is not None for i in layout.param_indices)
                for layout in self.layouts]

    # ------------------------------------------------------------ backward
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter ``index`` (autograd may call it from a device thread)."""
        if self._failed is not None or self._closed or self._refusal is not None:
            return  # the gradient stays in param.grad; step() raises the failure
        self._hook_section(self._take_hooked_gradient, index, param)

    def _hook_section(self, take: Callable[[int, torch.Tensor], None], index: int, tensor: torch.Tensor) -> None:
        """Run ``take(index, tensor)``, a gradient hook's work, holding the hook lock and Ctrl-C back (it waits until
        the gradient is taken and its block sent), unless the engine was closed by another thread meanwhile
        (:meth:`close` waits for a hook that runs); a :meth:`close` called inside it on this thread (a signal
        handler) is carried out as it ends. A close deferred to a call that a second Ctrl-C kept from doing it
        (:meth:`_deferred_close_dropped`) is carried out before anything is taken: the gradient stays where it is,
        as for a closed engine (done at the end, the hook's gradient taken, it closed the engine between backward
        and ``step()``: the state, whole until then, refused for good)."""
        if self._close_pending and self._deferred_close_dropped():
            return
        with self._hook_lock, self._interrupts:
            gate, since = self._interrupts, section_breaks(self._interrupts)
            if self._closed or self._forked_message() is not None:  # (a forked child: the gradient stays in .grad)
                return
            self._hook_owner = threading.get_ident()
            try:
                take(index, tensor)
            finally:
                self._hook_owner = None
                self._note_break_surely(gate, since, "a gradient hook (during backward)")
                if self._close_pending:
                    self._close_if_free()

    def _take_hooked_gradient(self, index: int, param: torch.Tensor) -> None:
        """:meth:`_on_grad` in its section: take ``param.grad`` as parameter ``index``'s gradient."""
        grad = param.grad
        if grad is None:
            return
        if not self.tracker.started:
            self._refuse_averaged_once()
            self._adopt_model_edits()  # before any block of this step is stepped from its masters
        arrivals = self.tracker.arrivals[index]
        try:
            self._take_gradient(index, grad, during_backward=True, owned=True, call=self.passes.call())
        finally:
            # Once counted, the gradient is the engine's even where its block's decision then raised (an
            # hparam refused when the step's first block is ready): left in .grad too, step() refused it and
            # a second backward summed it in twice.
            if self.tracker.arrivals[index] != arrivals:
                param.grad = None
                self.passes.note()
        self._poll()

    def _refuse_averaged_once(self) -> None:
        """At the first backward of an engine made without ``ddp``: refuse for good if a DDP module averages the
        gradients of its parameters (the model wrapped after the engine was made; see :mod:`sofx.offload.ddp`)."""
        if not self._check_averaged:
            return
        self._check_averaged = False
        try:
            refuse_averaged(self.params, after=True)
        except UnsupportedError as exc:
            self._refusal = exc
            raise

    def take_reduced_gradient(self, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index``'s gradient as ``DistributedDataParallel`` averaged it, from its communication hook
        as the bucket's all-reduce completes (on whichever thread completes it; see :mod:`sofx.offload.ddp`). It
        is the step's gradient so far (DDP averages the ``.grad`` autograd accumulated since the last step), so
        it replaces what an earlier synchronized backward of the step gave; it is copied (DDP reuses the
        bucket). Raises nothing: what it refuses, :meth:`end_reduced_backward` raises (and the backward's later
        gradients are not taken)."""
        if self._failed is not None or self._closed or self._reduced_error is not None:
            return  # step() raises the failure; end_reduced_backward() what was refused
        self._hook_section(self._take_reduced_gradient, index, grad)

    def _take_reduced_gradient(self, index: int, grad: torch.Tensor) -> None:
        """:meth:`take_reduced_gradient` in its hook section."""
        try:
            if not self.tracker.started:
                self._adopt_model_edits()  # before any block of this step is stepped from its masters
            # (the synchronized backward was counted at its bucket 0, before any bucket's average came)
            self._take_gradient(index, grad, during_backward=True, owned=False, replace=True,
                                call=self.passes.last_call)
            self._poll()
        except Exception as exc:
            # Raised out of the hook's future, DDP's reducer wrapped it in a RuntimeError; and DDP must get
            # the reduced bucket all the same. Raised by end_reduced_backward() instead, where a gradient
            # hook's error is without DDP: out of backward. As there, the gradients taken before are the
            # step's; those of this backward not taken are in .grad, where DDP writes them (step() takes
            # them as set by hand).
            self._reduced_error = exc

    def begin_reduced_backward(self) -> None:
        """A synchronized backward whose gradients ``ddp`` averages begins (:mod:`sofx.offload.ddp`), before the
        all-reduce of its bucket 0, the first (once per synchronized backward on every rank, as a rank that joined
        shadows it: not at each autograd backward reentrant checkpointing runs inside it): nothing refused yet, and
        the ranks decide whether they compare their states (:meth:`~sofx.offload.ddp.ReplicaWatch.exchange`) and,
        where they decided so, compare them here, every rank at the same point (:meth:`_compare_replicas`); what
        differs ``step()`` raises, on every rank, without a collective of its own. At the step's first exchange no
        block of the step is speculated nor in flight (the blocks ready before it are held): the whole state is
        compared, once the last step's operations are done. At a later one (a synchronized backward of an
        accumulation) blocks may be speculated meanwhile, by another thread (the completed buckets' gradients), so
        only what none changes is compared (the hparams and the loss scaler: an lr set on one rank between the
        backwards); the state is then compared at the next step's first exchange."""
        self._reduced_error = None
        self.passes.note()  # (DDP hands the averaged gradients of each bucket of this backward call)
        watch = self._replicas
        whole = watch.decision is None
        try:
            watch.exchange(self._hparams_text())
        except BaseException as exc:  # (gloo's timeout: step() raises it at once, see ReplicaWatch.fail)
            watch.fail(exc)
            raise
        if watch.decision.compare:
            try:
                watch.compared(self._compare_replicas(watch.decision, whole), whole)
            except BaseException as exc:  # (an interrupt, an error of its own: named as the comparison's)
                watch.fail(exc, comparing=True)
                raise

    def shadow_reduced_backward(self) -> None:
        """This rank joined (``DDP.join()``) and shadows the others' backward: it takes part in their exchange."""
        self._replicas.exchange("", joined=True)

    def end_reduced_backward(self) -> None:
        """The end of a backward whose gradients ``ddp`` averaged, after DDP wrote ``.grad``: raise what the engine
        refused as DDP handed it a gradient (:meth:`take_reduced_gradient`), as a gradient hook raises it out of
        backward without DDP."""
        self._reduced_grads = {i: _grad_mark(self.params[i].grad) for i in self.reduced}
        error, self._reduced_error = self._reduced_error, None
        if error is not None:
            raise error

    def note_rebuilt_grads(self) -> None:
        """``ddp`` rebuilt its buckets (:func:`sofx.offload.ddp._after_forward`), and with ``gradient_as_bucket_view``
        moved each ``.grad`` into a view of the new ones, its values copied: where the gradient DDP left at the step's
        last synchronized backward (:meth:`end_reduced_backward`) was not changed since (its version; or it was
        freed, DDP holding it no more), the new ``.grad`` is noted as that gradient."""
        for i, mark in self._reduced_grads.items():
            grad = self.params[i].grad
            if mark is None or grad is None or mark[0]() is grad:
                continue
            old = mark[0]()
            if old is None or (old._version == mark[1] and old.data_ptr() == mark[2]):
                self._reduced_grads[i] = _grad_mark(grad)

    def grad_kept_since_reduced(self, index: int) -> bool:
        """Whether ``.grad`` of averaged parameter ``index`` is the tensor DDP left there at the end of the step's
        last synchronized backward (:meth:`end_reduced_backward`; autograd may have accumulated into it since): DDP
        divides such a ``.grad`` in place where it is its bucket view (:func:`sofx.offload.ddp._scale_for_average`).
        False where none was noted this step."""
        mark = self._reduced_grads.get(index)
        return mark is not None and mark[0]() is self.params[index].grad

    def _reduced_grad_changed(self, index: int) -> bool:
        """Whether ``.grad`` of averaged parameter ``index`` is no longer the tensor DDP left there at the end of the
        step's last synchronized backward (:meth:`end_reduced_backward`): another tensor or none, other storage, or
        written in place (its version counter; a write into ``.grad.data`` is not seen). False where DDP left no
        gradient (a ``.grad`` set since is set by hand) or nothing was noted."""
        mark = self._reduced_grads.get(index)
        if mark is None:
            return False
        grad, (ref, version, ptr) = self.params[index].grad, mark
        return grad is None or grad is not ref() or grad._version != version or grad.data_ptr() != ptr

    def _refuse_short_params(self, indices: Sequence[int]) -> None:
        """Refuse (a :class:`LeafError` naming it, :meth:`_describe_param`) a model parameter of ``indices`` whose
        storage no longer holds it (freed with ``untyped_storage().resize_(0)``, as FSDP frees a parameter, or
        shrunk: :func:`~sofx.kernels.storage.refuse_short_storage`), before a master is copied into it (a write at
        address 0, or past its end)."""
        for i in indices:
            p = self.params[i]
            if not in_storage(p):
                refuse_short_storage(p, lambda: self._describe_param(i))

    def _refuse_freed_since_backward(self, indices: Sequence[int]) -> None:
        """Refuse (a :class:`LeafError` naming it, :meth:`_describe_param`) a parameter of ``indices`` (those
        changed since backward began this step, :meth:`_edited_params`) whose storage no longer holds it: freed
        with ``untyped_storage().resize_(0)``, as FSDP frees a resharded parameter, or shrunk
        (:func:`~sofx.kernels.storage.storage_shortfall`). Its block began stepping from its master at backward,
        so its memory given back is still a change of it: the step is dropped (``zero_grad()``), or the parameter
        freed only after ``step()``. Nothing is changed."""
        for i in indices:
            p = self.params[i]
            short = None if in_storage(p) else storage_shortfall(p)
            if short is not None:
                raise LeafError(short_storage_message(
                    self._describe_param(i), p, *short,
                    remedy="this was between backward and step(), after this step's blocks began stepping from "
                           "their masters, and step() writes the new values into it: free parameters after step() "
                           "(or reshard before backward), or give it its memory back (p.data = a tensor holding "
                           "its values; they are then taken as its master) and call zero_grad() to drop this step"))

    def _describe_param(self, index: int) -> str:
        """Parameter ``index`` for an error message: ``parameter 3 (param_groups[0]['params'][3], shape (4, 5))``."""
        group = bisect.bisect_right(self._group_starts, index) - 1
        path = param_path(self._group_starts, group, index)
        return f"parameter {index} ({path}, shape {tuple(self.params[index].shape)})"

    def _check_gradient(self, index: int, grad: torch.Tensor) -> None:
        """Refuse parameter ``index``'s gradient where it cannot be taken into its block's buffer, before anything
        of it is counted: a sparse one, one of another shape than the parameter (``p.grad.data = t``: torch checks
        the shape only where ``.grad`` itself is assigned, and ``torch.optim.AdamW`` then raises at the mismatch;
        a reshape took one of as many elements), or one whose elements reach past the end of its storage
        (:func:`~sofx.kernels.storage.storage_shortfall`: its memory freed with ``untyped_storage().resize_(0)``, as
        FSDP frees tensors, or shrunk; the native copy read outside any allocation, a segmentation fault)."""
        if grad.is_sparse or grad.layout != torch.strided:
            raise LeafError(f"parameter {index} ({tuple(grad.shape)}): sparse gradients are not supported by the "
                            "offload engine (e.g. nn.Embedding(sparse=True)); use dense gradients")
        shape = self.params[index].shape
        if grad.shape != shape:
            raise LeafError(f"{self._describe_param(index)}: .grad has shape {tuple(grad.shape)}, expected "
                            f"{tuple(shape)} (set through .grad.data, which torch does not check; torch.optim "
                            "refuses it at the step too)")
        refuse_short_storage(grad, lambda: f"{self._describe_param(index)}: .grad")

    def _take_gradient(self, index: int, grad: torch.Tensor, during_backward: bool, owned: bool,
                       replace: bool = False, call: int | None = None) -> None:
        """Record parameter ``index``'s gradient; ``owned``: nobody else holds ``grad`` (autograd's
        accumulated gradient once ``param.grad`` is cleared), so it may be borrowed and summed into;
        ``replace``: ``grad`` replaces an earlier arrival of this step instead of adding to it; ``call``: the
        backward call of the step it comes from, ``None`` where that is not known (its final arrival is then
        told by the count of its arrivals: :mod:`sofx.offload.arrivals`). The arrival is
        counted once the gradient is in the block's buffer: one that cannot be taken (:meth:`_check_gradient`: a
        ``.grad`` set by hand through ``.data`` to another shape, freed memory) raises with nothing counted, and
        stays the caller's."""
        self._check_gradient(index, grad)
        if not self.tracker.started:
            self._note_expected()
        arrival = self.tracker.upcoming(index, call)
        b = arrival.block
        layout = self.layouts[b]
        view = self._grad_views[b][arrival.slot]
        if grad.requires_grad:  # (backward(create_graph=True)): nothing here is recorded by autograd
            grad = grad.detach()
        if arrival.late and self._deferred:
            self._record(self._wait())  # the block's decision, taken in the executor, is known after this
        undone = arrival.late and self._speculated[b]
        if undone:
            # The speculative step's record refers to this buffer: undo it before summing in place;
            # validation then steps the block with the sum (taken: False; the report says "step").
            self._events.append(("undo_now", b))
            self._run_now(BlockOp(next(self._seq), "undo_now", b), layout)
            self._speculated[b] = False
            self._published[b] = None
        # (no torch.no_grad() needed: neither ``grad`` nor the buffers require grad; it would cost ~2 us a hook)
        if arrival.first or replace:
            if (owned and self._borrowing[b] and grad.dtype == view.dtype and grad.device == view.device
                    and grad.is_contiguous()):
                self._grads[b][arrival.slot] = grad.view(-1)  # a view of autograd's gradient: no copy
            else:
                # casts to the master dtype, copies across devices; one pass with the sum of squares where
                # the native library can (the process executor's copies into shared memory)
                self._slot_sumsq[b][arrival.slot] = copy_with_sumsq(view, grad)
                self._grads[b][arrival.slot] = view
        else:
            target = self._grads[b][arrival.slot]
            target.add_(grad.reshape(-1).to(target.device))
            self._slot_sumsq[b][arrival.slot] = None
        self.tracker.arrive(index, call)
        if arrival.late:
            self._events.append(("late_gradient", b))
            if self._tally is not None and self._tally.decisions[b] is not None:
                self._take_snapshot_reports()  # what its step held is counted before its undo releases it
                self._tally = on_late_gradient(self._ctx, self._tally, b, self._block_sumsq(b), undone=undone)
        elif arrival.ready:
            self._block_ready(b, during_backward)

    def _block_ready(self, b: int, during_backward: bool) -> None:
        layout, t = self.layouts[b], self.tensors[b]
        arrived = self.tracker.present(b)
        self._zero_absent(b, arrived)
        present = self._stepped(b, arrived)
        if not during_backward:
            return  # stepped in step(), not speculated (its sum of squares is taken there)
        # (read once, under the GIL during backward: the held checks and the eligibility's memo key; the block is not
        # stepped before its decision, so they stay its counts)
        counts = None if layout.on_device else t.counts.tolist()
        held = self._held_from_speculating(b, present, counts)
        if held:
            self._held[b] = held  # (likewise; the report says why, where no block of the step was speculated)
            return
        self._begin()
        grads = self._op_grads(b)
        publish = self._publish_mask(b, present)
        # grads_finite: a block is speculated only when the sum of squares _decide takes of these very
        # gradient values (the buffer, or the borrowed tensors in ``grads``) is finite; Adam need not check.
        if self._deferred:
            ticket = self._tickets
            self._tickets += 1
            self.executor.submit(BlockOp(next(self._seq), "ready", b,
                                         lambda: self._decide_in_turn(ticket, b, present, grads, publish, counts),
                                         present, grads, publish, grads_finite=True))
            return
        decision = self._decide(b, present, grads, publish, counts, mark=False)
        if decision is not None:
            self.executor.submit(BlockOp(next(self._seq), "speculate", b, decision, present, grads, publish,
                                         grads_finite=True))
            self._mark_speculated(b, publish)  # after the submission (an interrupt between would leave a
            # block marked whose step was never sent, and zero_grad() would ask the worker to undo it)

    def _held_from_speculating(self, b: int, present: Sequence[bool], counts: Sequence[int] | None) -> str:
        """Why block ``b``, ready during backward, is not offered for speculation (stepped in ``step()``), else "":
        it is kept on the device (``counts`` None: they are not read there), a parameter it steps (``present``; its
        step count in ``counts``) has a count at int64's largest or, in a step
        that speculates, a step size ``lr / (1 - beta1**t)`` beyond float32 with the step's hparams (``step()``
        refuses its step, :meth:`_check_stepped_counts`: not "ineligible", which says its step could not be undone),
        or under ``ddp`` the ranks have not decided yet whether to compare their states (no synchronized backward
        yet), compare them now, or found them different (``step()`` raises). Begins the step (:meth:`_begin`) where
        it gets to the step size."""
        if counts is None:
            return "kept on the device (n_device_blocks): a block there is stepped in step(), not speculated"
        full = self._count_at_max(b, counts, present)
        if full is not None:
            return (f"{full}: its step count is at int64's largest, {COUNT_MAX}: the next step's count cannot be "
                    "stored, and step() refuses the step")
        watch = self._replicas
        if watch is not None and watch.holds_speculation:
            if watch.error is not None:
                return "the ranks' optimizer states differ (step() raises): no block is speculated"
            if watch.decision is None:
                return ("under ddp no block is speculated before the ranks decide, at a synchronized backward, "
                        "whether to compare their optimizer states (its gradient came before one: from a backward "
                        "under no_sync(), or of a parameter DDP does not average)")
            return "under ddp no block is speculated while the ranks compare their optimizer states"
        self._begin()
        if not self._ctx.speculating:  # (no block's eligibility is asked: its step size is checked in step())
            return ""
        try:
            self._check_step_sizes(b, counts, present, self._ctx.hparams[b])
        except HParamError as exc:
            return f"step() refuses its step with these hparams: {exc}"
        return ""

    def _held_report(self, report: StepReport) -> StepReport:
        """``report``, saying that the step did not speculate and why (:meth:`_held_from_speculating`), where it
        was allowed to but no block was offered for speculation, those ready during backward all held from it
        (every block on the device, ``ddp``'s comparison): it said ``speculating=True`` with no reason."""
        if not (report.speculating and self._held) or any(d is not None for d in self._tally.decisions):
            return report
        why = "; ".join(dict.fromkeys(self._held.values()))
        what = "every block" if len(self._held) == len(self.layouts) else "every block ready during backward"
        return dataclasses.replace(report, speculating=False,
                                   not_speculating_reason=f"{what} was held from speculating: {why}")

    def _held_reasons(self, plan: ValidationPlan) -> ValidationPlan:
        """``plan``, the step action of each block held from speculating (:meth:`_held_from_speculating`) saying why
        it was held: validation, which never saw the block ready, said "the block was not reported ready during
        backward"."""
        if not self._held:
            return plan
        actions = tuple(a._replace(reason=self._held[a.block])  # (a copy shares the action's applied marker)
                        if a.kind == "step" and a.block in self._held and self._tally.decisions[a.block] is None
                        else a for a in plan.actions)
        return plan._replace(actions=actions)

    def _decide_in_turn(self, ticket: int, *args: Any) -> Any:
        """:meth:`_decide` after the decisions of every block that was ready before (the worker and a
        helping ``step()`` may run "ready" operations at the same time; decisions stay in arrival order)."""
        deadline = time.monotonic() + self.timeout
        with self._turn_cond:
            while self._turn != ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorTimeout(f"the decision for ready {self.describe_block(args[0])} waited "
                                          f"{self.timeout:g} s for the decisions of earlier blocks")
                self._turn_cond.wait(left)
        try:
            return self._decide(*args)
        finally:
            with self._turn_cond:
                self._turn += 1
                self._turn_cond.notify_all()

    def _decide(self, b: int, present: tuple[bool, ...], grads: tuple[torch.Tensor, ...] | None,
                publish: tuple[int, ...] | None, counts: Sequence[int], mark: bool = True) -> Any:
        """Ask the speculation layer about ready block ``b`` (``counts``: its step counts, as it was ready); its
        decision if it speculates, else None.

        Runs on the main thread (process executor) or in the executor, in arrival order (in-process
        executors: nothing else touches the tally during backward). ``mark=False``: the caller marks the block
        speculated (:meth:`_mark_speculated`) once it submitted the step.
        """
        layout, t, ctx = self.layouts[b], self.tensors[b], self._ctx
        self._events.append(("ready", b))
        self._take_snapshot_reports()  # what the steps so far hold (those refused: nothing) is known
        flat = uses_flat_layout(t, present, grads is not None)
        self._tally, decision = on_block_ready(
            ctx, self._tally, b, self._block_sumsq(b),
            # Asked only when the sum of squares is finite, i.e. every gradient element is.
            lambda: self._eligibility(b, flat, present, grads, counts))
        if not decision.speculate:
            return None
        if mark:
            self._mark_speculated(b, publish)
        return decision

    def _take_snapshot_reports(self) -> None:
        """Record in the tally the snapshot bytes the speculative steps reported since the last call hold, and
        those taken back (``why`` not None)."""
        while self._snapshot_reports:
            b, why, nbytes = self._snapshot_reports.popleft()
            if why is None:
                self._tally = on_speculation_held(self._ctx, self._tally, b, nbytes)
                continue
            self._tally = on_speculation_refused(self._ctx, self._tally, b, why)
            self._refused_bytes[b] = nbytes

    def _mark_speculated(self, b: int, publish: tuple[int, ...] | None) -> None:
        self._speculated[b] = True
        self._published[b] = publish
        self._events.append(("speculate", b))

    def _eligibility(self, b: int, flat: bool, present: tuple[bool, ...], grads: tuple[torch.Tensor, ...] | None,
                     counts: Sequence[int]) -> Any:
        """Block ``b``'s eligibility for a speculative step, its gradients known to be finite (``counts``: its step
        counts, none at int64's largest nor with a step size beyond float32: such a block is held,
        :meth:`_held_from_speculating`).

        With finite gradients the undo strategy depends only on the hparams, the grad scale, the
        layout, the dtypes and which parameters take their first step (L2 decay keeps the parameter
        there: ``sofx.adam.L2_FIRST_STEP_REASON``), so the last answer is reused while those are unchanged:
        Adam's planning is Python work that would otherwise run for every block of every step (and hold the
        GIL against backward). Not where the strategy also reads the parameters
        (:meth:`sofx.Adam.strategy_reads_params`: a step of one that became inf cannot be undone, and the cached
        answer speculated it).
        """
        ctx, layout, t = self._ctx, self.layouts[b], self.tensors[b]
        hp = ctx.hparams[b]
        # (which parameters take their first step: their slots, () for none, found by a scan at C speed)
        firsts = tuple(i for i, c in enumerate(counts) if c == 0) if 0 in counts else ()
        key = (flat, present, tuple(None if x is None else float(x) for x in hp), float(ctx.grad_scale),
               None if grads is None else tuple(None if g is None else g.dtype for g in grads), firsts)
        memo = self._eligibility_memo[b]
        if memo is not None and memo[0] == key and not self.adam.strategy_reads_params(hp.weight_decay):
            el = memo[1]
        else:
            el = combined_eligibility(self.adam, t, layout, flat, present, hp, ctx.grad_scale, grads, finite=True)
            self._eligibility_memo[b] = (key, el)
        if el.eligible:
            self._planned_bytes[b] = el.snapshot_bytes  # what the step holds beyond it is learnt (snapshot_needs)
        budget = ctx.config.snapshot_budget_bytes
        if not el.eligible or budget is None:
            return el
        nbytes, why = self._snapshot_needs.need(b, el.snapshot_bytes, budget - self._tally.snapshot_bytes)
        return el._replace(snapshot_bytes=nbytes, reason=f"{el.reason}; {why}" if el.reason else why) if why else el

    def _zero_absent(self, b: int, arrived: Sequence[bool]) -> None:
        """Parameters without a gradient this step get a zeroed buffer slice (it held old values);
        used only where ``missing_grad="zero"`` steps them."""
        layout, t = self.layouts[b], self.tensors[b]
        for slot, has in enumerate(arrived):
            if not has:
                view = t.grad[layout.span(slot)]
                view.zero_()
                self._grads[b][slot] = view
                self._slot_sumsq[b][slot] = 0.0

    def _op_grads(self, b: int) -> tuple[torch.Tensor, ...] | None:
        """The gradients to send with an operation on block ``b`` (None: they are in its buffer)."""
        return tuple(self._grads[b]) if self._borrowing[b] else None

    def _block_sumsq(self, b: int) -> float:
        """Sum of squares of block ``b``'s gradient (absent parameters zeroed first), float64: the sums
        taken while copying the gradients in where every parameter has one, else one pass now."""
        if not self._borrowing[b]:
            slots = self._slot_sumsq[b]
            if all(s is not None for s in slots):
                return total_sumsq(slots)
            return grad_sumsq(self.tensors[b].grad)
        return total_sumsq([None if g is None else grad_sumsq(g) for g in self._grads[b]])

    def _run_now(self, op: BlockOp, layout: BlockLayout) -> None:
        if layout.on_device:
            raise_failures([self.device_runner.run(op)], f"device blocks ({self.device})", self.describe_block)
            return
        self.executor.submit(op)
        self._record(self._wait())

    def _poll(self) -> None:
        self._record(self.executor.poll())

    def _record(self, results: Sequence[OpResult]) -> None:
        for r in results:
            if not r.ok and self._failed is None:
                # A result polled during backward (a wait raises its failures itself): the block's speculative
                # step did not happen as planned; step() must not commit or publish it. The engine stops here.
                self._failed = ExecutorError(failure_message(r, f"{self.executor_name} executor",
                                                             self.describe_block))
            if r.ok and r.held_bytes is not None:
                # What the speculative step holds (chunks it found it must keep, or less than was reserved for it):
                # the blocks decided next see it.
                self._snapshot_reports.append((r.block, None, r.held_bytes))
            if r.refused is not None:
                # Taken back as it ran (its snapshot would go beyond the budget): validation steps the block.
                self._snapshot_reports.append((r.block, r.refused, r.refused_bytes))
                self._speculated[r.block] = False
                self._published[r.block] = None
                self._events.append(("refused", r.block))
            elif r.kind == "speculate" or (r.kind == "ready" and (self._speculated[r.block] or not r.ok)):
                self._events.append(("speculated" if r.ok else "speculate_failed", r.block))

    def _wait(self, help: bool = False) -> list[OpResult]:
        try:
            if help and isinstance(self.executor, ThreadExecutor):
                return self.executor.wait(self.timeout, help=True)  # step() runs queued block operations too
            return self.executor.wait(self.timeout)
        except ExecutorError as exc:
            self._failed = exc
            raise

    def wait(self) -> None:
        """Block until every operation submitted to the executor has finished (one call at a time, as ``step()``:
        see :meth:`_exclusive`)."""
        self._check_usable()
        with self._exclusive("wait()"):
            self._wait_all()

    def _wait_all(self) -> None:
        """:meth:`wait` inside a call that holds the engine."""
        with self._interrupts:  # the results taken are recorded (a failure among them stops the engine)
            self._record(self._wait())

    # ------------------------------------------------------------ step
    def _forked_message(self) -> str | None:
        """Why this engine cannot work in this process, a child forked from the one that made it (``None``: it
        can). The executor's worker thread does not exist in the child (a step waited for it until the timeout),
        and the process executor's worker and shared memory (gradient buffers, masters, moments) are the parent's:
        a gradient taken in the child went into the parent's step. The inline executor works on the child's own
        copy of the state, as ``torch.optim`` does (also the one the process executor runs where every block lives
        on the device: no worker, no shared memory)."""
        if self._pid == os.getpid() or isinstance(getattr(self, "executor", None), InlineExecutor):
            return None
        owner = "worker thread is" if self.executor_name == "thread" else "worker process and shared memory are"
        return (f"this optimizer was created in process {self._pid}, and this process ({os.getpid()}) was forked "
                f"from it (os.fork, multiprocessing's \"fork\" start method): its {self.executor_name} executor's "
                f"{owner} that process's, so it cannot step here (gradients stay in .grad); create an optimizer in "
                "this process, or use the \"spawn\" start method")

    def _check_usable(self) -> None:
        dropped = self._deferred_close_dropped()
        if dropped:
            raise SofxError(f"the optimizer is closed (the close() called inside {dropped} on its thread, a signal "
                            "handler's, was to be done as that call ended; a second Ctrl-C broke into it there, "
                            "and this call did the close)")
        if self._closed:
            raise SofxError("the optimizer is closed")
        forked = self._forked_message()
        if forked is not None:
            raise SofxError(forked)
        if self._refusal is not None:
            raise UnsupportedError(str(self._refusal))
        lost = self.hooks.superseded_at
        if lost is not None:
            p = self.params[lost] if lost >= 0 else None
            which = f"parameter {lost} (shape {tuple(p.shape)})" if p is not None else "one of its parameters"
            raise SofxError(f"another optimizer was created over {which} of this one and takes their gradients "
                            "now: this optimizer cannot step any more; use the new one, and close() this one (an "
                            "optimizer created again over the same parameters replaces the old)")
        if self._failed is not None:
            raise ExecutorError(f"the offload engine failed earlier and cannot continue (close() this optimizer; to "
                                "go on training, create a new one and load a checkpoint saved between steps into "
                                f"it): {self._failed}") \
                from self._failed

    @without_grad  # (its publish and copy into the parameters: torch.no_grad() blocks a second Ctrl-C can leave off)
    def step(self) -> EngineStepReport:
        """Validate this step's speculative updates and complete the step; returns its report. Under ``ddp`` it
        enters no collective after a synchronized backward (see :meth:`_check_replicas`).

        Ctrl-C during ``step()`` is raised as it returns (or raises): the step is taken whole or, where it
        refuses, not begun (a second Ctrl-C goes through at once, see :mod:`sofx.offload.interrupts`)."""
        self._check_usable()
        with self._exclusive("step()"), self._interrupts:
            if self._replicas is None:
                return self._step()
            self._check_replicas(self._replicas)
            report = self._step()
            self._replicas.stepped(self._hparams_text())  # (the next exchange compares them: see ReplicaWatch)
            return report

    def _check_replicas(self, watch: ReplicaWatch) -> None:
        """Under ``ddp``, raise the same error on every rank where the ranks' step counts, hparams, loss scaler or
        the contents a rank changed differ (one rank loaded an older state dict, or none; assigned a state alone),
        before anything is stepped: DDP compares the parameters at its construction only, and each rank would step
        its own state. The ranks decide together whether to compare (:class:`~sofx.offload.ddp.ReplicaWatch`: a
        rank's state changed since they last compared, construction included, or their hparams differ) and compare
        at the step's synchronized backward (:meth:`begin_reduced_backward`): here only its outcome is raised, no
        collective is entered (a rank that skips this ``step()`` -- an error between backward and ``step()`` caught
        on one rank -- leaves no other waiting; it drops the step at its ``zero_grad()``, and the next backward
        compares the states: see :meth:`~sofx.offload.ddp.ReplicaWatch.drop_step`). The outcome stands until the
        step ends or is dropped: another ``step()`` raises it again. So does the failure of that exchange (a rank
        that never came to the backward, within the process group's timeout): ``step()`` raises it at once,
        entering no collective on a group that may be broken, until ``zero_grad()``
        (:meth:`~sofx.offload.ddp.ReplicaWatch.fail`). Where the step had no synchronized backward
        the ranks exchange and compare here: that ``step()`` is a collective, and where it raises the step's
        decision is dropped (the next ``step()`` decides anew, with what changed since); a rank that takes no part
        in its exchange (its optimizer closed, a ``step()`` skipped on it) makes the others' raise after the
        process group's timeout, saying so (:func:`~sofx.offload.ddp.unmatched_step_error`): gloo's raw timeout
        before.

        Its cost at every step: one all-reduce of 11 int64 at each synchronized backward (about 0.1-0.3 ms, 2 gloo
        ranks on one machine) and the hparams' digests (at backward, and of those each ``step()`` used: an hparam
        set on a rank alone between backward and ``step()`` is found at the next exchange; see
        :class:`~sofx.offload.ddp.ReplicaWatch`). Where the ranks compare: about 0.5 ms (one all-reduce of
        two int64 and the wait for it) and 8 ms more per 1,000 blocks (reading and naming each block's counts;
        measured with 2 gloo ranks on one machine, 10 blocks to 10^4), one pass over each changed content (a sum
        of its bits), inside backward before its first bucket's all-reduce; the blocks are speculated after it
        where nothing differs."""
        if watch.failed is not None:  # (the exchange at this step's backward: no collective, the group may be broken)
            raise watch.failure_error() from watch.failed
        if watch.error is not None:
            raise watch.error.with_traceback(None)  # (found at backward, on every rank)
        if watch.decision is not None:
            return  # (decided, and compared where decided so, at backward)
        try:
            watch.exchange(self._hparams_text())
        except RuntimeError as exc:  # (gloo's timeout: a rank took no part in this step()'s exchange)
            raise unmatched_step_error(exc) from exc
        if not watch.decision.compare:
            return
        error = self._compare_replicas(watch.decision, whole=True)
        if error is not None:
            # (raised on every rank: each decides anew at its next step, taking in what changes meanwhile)
            watch.forget_step()
            raise error
        watch.compared(None)

    def _compare_replicas(self, decision: Decision, whole: bool) -> SofxError | None:
        """The ranks' comparison of their states (every rank calls it at the same point): the error where they
        differ, else ``None`` (:func:`~sofx.offload.ddp.check_replicas` of
        :func:`~sofx.offload.engine_state.replica_entries`; ``decision.contents``: the keys whose contents a rank
        changed; ``decision.used``: the hparams this rank's last step used, first, where the ranks' differ;
        ``whole=False``: only the hparams and the loss scaler, what no block operation changes). A rank that cannot
        read its state (an executor that failed as the last step's operations are waited for) still takes part,
        with an entry naming its error, which the others name: a rank raising before the comparison's all-reduce
        left them waiting in it alone."""
        entries = {} if decision.used is None else {USED_HPARAMS: decision.used}
        try:
            if whole:
                self._wait_all()  # (the last step's operations: the counts are read)
            entries.update(replica_entries(self, decision.contents, blocks=whole))
        except Exception as exc:
            entries["this rank's optimizer state"] = f"unreadable ({type(exc).__name__}: {exc})"
        try:
            check_replicas(self._route, entries, decision.joined)
        except SofxError as exc:
            return exc
        return None

    def _hparams_text(self) -> str | None:
        """The groups' hparams as text, for the ranks' exchange (:meth:`ReplicaWatch.exchange`); ``None`` where
        reading them raises (the engine refuses one, or ``hparams_fn`` raised something else: a group without
        ``'lr'``, a ``KeyError``): that is this rank's own error, raised where the hparams are read (as a step's
        first block is ready, out of backward; or in ``step()``), not a difference between the ranks. Raised here,
        in the communication hook, it skipped this rank's part in the exchange and its bucket's all-reduce: the
        other ranks waited in them alone."""
        try:
            return "; ".join(hparams_text(hp) for hp in self.hparams_fn())
        except Exception:
            return None

    def _step(self) -> EngineStepReport:
        for i, p in enumerate(self.params):
            if self.tracker.arrivals[i] == 0:
                continue
            if i in self.reduced and self._reduced_grad_changed(i):
                raise SofxError(f"parameter {i} (shape {tuple(p.shape)}): .grad was changed after backward took this "
                                "step's gradient of it (the average DistributedDataParallel wrote there), so the "
                                "change would be ignored: with ddp= the offload engine takes DDP's averages from its "
                                "communication hook during backward; change gradients in a tensor hook "
                                "(Tensor.register_hook) instead, or call zero_grad() to drop this step (a backward "
                                "under no_sync() after a synchronized one of the step changes .grad too: synchronize "
                                "the last)")
            if p.grad is not None and i not in self.reduced:
                raise SofxError(f"parameter {i} (shape {tuple(p.shape)}): .grad was set after backward took this "
                                "step's gradient of it, so it would be ignored: the offload engine takes gradients "
                                "in hooks during backward (they are not left in .grad); change them in a tensor hook "
                                "(Tensor.register_hook) instead, or call zero_grad() to drop this step")
        if self.tracker.started:
            edited = self._edited_params()
            self._refuse_freed_since_backward(edited)
            if edited:
                i = edited[0]
                raise SofxError(f"parameter {i} (shape {tuple(self.params[i].shape)}) was changed in place between "
                                "backward and step(), after this step's blocks began stepping from their masters; "
                                "change parameters after step() or before backward (they are then taken as the "
                                "new masters), or call zero_grad() to drop this step")
        else:
            self._adopt_model_edits()
            self._note_expected()
        self._settle_reduced()
        self._events.append(("step_called", -1))
        # Gradients set by hand (no hook fired) are taken now, all checked before the first is; their blocks are
        # stepped late.
        by_hand = [i for i, p in enumerate(self.params) if p.grad is not None and self.tracker.arrivals[i] == 0]
        for i in by_hand:
            self._check_gradient(i, self.params[i].grad)
        for i in by_hand:
            p = self.params[i]
            self._take_gradient(i, p.grad, during_backward=False, owned=False)
            p.grad = None
        if not self.tracker.started and self.speculation.missing_grad != "zero" and not any(self._zero_grads):
            warnings.warn("sofx.offload: step() found no gradients (no backward since the last step(), or every "
                          "parameter frozen), so nothing is stepped; torch.optim would step again with what is "
                          "left in .grad, but here step() consumes a backward's gradients", RuntimeWarning,
                          stacklevel=caller_stacklevel())
        self._begin()
        self._record(self._wait(help=True))
        self._take_snapshot_reports()
        self._note_gradients()
        sumsq: list[float | None] = []
        presents: list[tuple[bool, ...]] = []
        for layout in self.layouts:
            b = layout.index
            arrived = self.tracker.present(b)
            present = self._stepped(b, arrived)
            presents.append(present)
            kept = any(self._zero_grads[i] for i in layout.param_indices)  # a zeroed .grad: stepped, not skipped
            if self._tally.decisions[b] is not None:
                # (None: every gradient of the block was retracted after it was ready, see _retract: it has none)
                sumsq.append(self._tally.block_sumsq[b] if any(arrived) or kept else None)
                continue
            self._zero_absent(b, arrived)
            sumsq.append(self._block_sumsq(b) if any(arrived) else 0.0 if kept else None)
        # taken: a block whose speculative step a late gradient undid (undo_now) or that was taken back as it ran
        # has nothing left to undo; validation plans (and reports) it as the plain step (or skip) it runs.
        # stepped: a block with a parameter the step steps (_stepped: no frozen one is stepped with zeros under
        # missing_grad="zero"); the hparams of the others are not read
        stepped = [any(present) for present in presents]
        plan = self._held_reasons(plan_validation(self._ctx, self._tally, sumsq, hparams=self.block_hparams(),
                                                  taken=list(self._speculated), stepped=stepped))
        _check_float32_hparams(plan.actions, stepped)  # (before anything is applied)
        self._check_stepped_counts(plan.actions, presents)
        self._snapshot_needs.after_step(self._tally.decisions, self._refused_bytes, self._planned_bytes)
        self._refused_bytes, self._planned_bytes = {}, {}
        return self._apply(plan, presents, sumsq)

    def _count_at_max(self, b: int, counts: Sequence[int], present: Sequence[bool]) -> str | None:
        """The first parameter of block ``b`` (``counts``: its parameters' step counts) that the step steps
        (``present``) and whose count is int64's largest (:data:`~sofx.adam.COUNT_MAX`), named as the engine's errors
        name parameters, with its count; else None."""
        if COUNT_MAX not in counts:  # (an int64 count is at most COUNT_MAX; a scan at C speed, mostly all there is)
            return None
        layout = self.layouts[b]
        for index, c, stepped in zip(layout.param_indices, counts, present):
            if stepped and c >= COUNT_MAX:
                return (f"parameter {index} = {param_path(self._group_starts, layout.group, index)}: state['step'] "
                        f"= {c}")
        return None

    def _check_step_sizes(self, b: int, counts: Sequence[int], present: Sequence[bool], hp: AdamHParams,
                          redo: bool = False) -> None:
        """Refuse (:func:`~sofx.adam.check_step_size`, naming the parameter) a step of block ``b`` with hparams ``hp``
        whose size ``lr / (1 - beta1**t)`` is beyond float32 (the masters') for a parameter it steps (``present``),
        ``t`` from its count (``counts``; ``redo``: the count a speculative step reached, the redo's ``t``)."""
        if not self.adam.variant.bias_correction:
            return
        layout = self.layouts[b]
        every = all(present)
        stepped = counts if every else [c for c, s in zip(counts, present) if s]
        # Each count once (the parameters of a block share a count, mostly: told at C speed), in the order the
        # parameters first take it: the first refused names the first parameter refused.
        shared = stepped and stepped.count(stepped[0]) == len(stepped)
        for c in stepped[:1] if shared else dict.fromkeys(stepped):
            slot = counts.index(c) if every else next(i for i, (x, s) in enumerate(zip(counts, present))
                                                      if s and x == c)
            index = layout.param_indices[slot]
            check_step_size(f"parameter {index} = {param_path(self._group_starts, layout.group, index)}", hp,
                            c - 1 if redo else c, torch.float32)

    def _check_stepped_counts(self, actions: Sequence[BlockAction], presents: Sequence[tuple[bool, ...]]) -> None:
        """Refuse, before anything is applied, a step (or an undo+redo's redo) of a parameter that
        :meth:`sofx.Adam.update` refuses for its count: a :class:`~sofx.errors.LeafError` where the count is int64's
        largest (it would wrap to -2^63), an :class:`~sofx.errors.HParamError` where the step's size ``lr / (1 -
        beta1**t)`` is beyond float32 (:meth:`_check_step_sizes`); each naming the parameter. The block's step raised
        in the executor, the blocks before it stepped, and the engine stopped for good. Such a block is never
        speculated (held, :meth:`_held_from_speculating`); an undo+redo redoes a speculative step at the count it
        reached (that count may be the largest), with the hparams of step() (they may have changed since)."""
        for action in actions:
            if action.kind not in ("step", "undo_redo"):
                continue
            counts = self.tensors[action.block].counts.tolist()
            self._check_step_sizes(action.block, counts, presents[action.block], action.hparams,
                                   redo=action.kind == "undo_redo")
            if action.kind != "step":
                continue
            full = self._count_at_max(action.block, counts, presents[action.block])
            if full is not None:
                raise LeafError(f"{full}: step count {COUNT_MAX} is int64's largest; the next step's count, "
                                f"{COUNT_MAX + 1}, cannot be stored (it would wrap to a negative count); set "
                                "opt.state[p]['step'] to a smaller count")

    def _settle_reduced(self) -> None:
        """After backward, the parameters whose gradients ``ddp`` averages: DDP wrote the average the engine took
        into ``.grad``, consumed here as the gradient hooks consume autograd's; where it found a parameter unused
        on every rank (``find_unused_parameters``, ``static_graph``) it left ``.grad`` as it was, ``None``, and
        the zeros its bucket carried are no gradient: the parameter is not stepped, as torch.optim does not step
        a parameter whose ``.grad`` is ``None``; a ``.grad`` set there since is set by hand (taken next)."""
        for i in sorted(self.reduced):
            if self.tracker.arrivals[i] == 0:
                continue  # (a .grad of a backward DDP did not average, under no_sync(): taken as set by hand)
            p = self.params[i]
            left = self._reduced_grads[i] is None if i in self._reduced_grads else p.grad is None
            if left:
                self._retract(i)
            else:
                p.grad = None

    def _retract(self, index: int) -> None:
        """Parameter ``index`` has no gradient this step after all (:meth:`_settle_reduced`): its block's
        speculative step, taken with zeros for it, is undone, and validation steps the block without it (a block
        left without any gradient as one that had none: not stepped, reported so)."""
        b = self.tracker.where[index][0]
        if self._deferred:
            self._record(self._wait())  # the block's decision, taken in the executor, is known after this
        undone = self._speculated[b]
        if undone:
            self._events.append(("undo_now", b))
            self._run_now(BlockOp(next(self._seq), "undo_now", b), self.layouts[b])
            self._speculated[b] = False
            self._published[b] = None
        self.tracker.retract(index)
        self._zero_absent(b, self.tracker.present(b))
        if self._tally is not None and self._tally.decisions[b] is not None:
            self._take_snapshot_reports()  # what its step held is counted before its undo releases it
            self._tally = on_late_gradient(self._ctx, self._tally, b, self._block_sumsq(b), undone=undone)

    def _apply(self, plan: ValidationPlan, presents: list[tuple[bool, ...]],
               sumsq: list[float | None]) -> EngineStepReport:
        """Run ``plan``'s actions (commit, undo+redo, late steps; ``sumsq``: each block's sum of squares),
        publish the new masters, end the step."""
        stepped: list[int] = []
        for action, layout in zip(plan.actions, self.layouts):
            if action.kind == "skip" or (action.kind == "commit" and not layout.on_device):
                if action.kind == "commit":
                    stepped.append(layout.index)
                    self._events.append(("commit", layout.index))
                continue
            self._events.append((action.kind, layout.index))
            publish = None
            if action.kind in ("undo_redo", "step") and not layout.on_device:
                publish = self._publish_mask(layout.index, presents[layout.index])
            self._published[layout.index] = publish
            # sumsq[b] was taken on exactly the gradient values the action steps with (in step() above, or
            # during backward and again after a late gradient); finite means every element is.
            s = sumsq[layout.index]
            finite = math.isfinite(s) if s is not None else action.zero_grad  # zero_grad: zeroed buffers
            op = BlockOp(next(self._seq), "apply", layout.index, action, presents[layout.index],
                         self._op_grads(layout.index), publish, grads_finite=finite)
            if layout.on_device:
                raise_failures([self.device_runner.run(op)], f"device blocks ({self.device})", self.describe_block)
            else:
                self.executor.submit(op)
            if action.kind in ("undo_redo", "step", "commit"):
                stepped.append(layout.index)
        self.executor.submit(BlockOp(next(self._seq), "commit_all"))
        self.device_runner.run(BlockOp(next(self._seq), "commit_all"))
        self._record(self._wait(help=True))  # the thread executor's actions run on two threads
        if plan.error is not None:
            self._events.append(("done", -1))
            self._reset_step()
            raise plan.error
        self._publish_to_model(stepped, presents)
        self._note_versions()
        self.scaler_state, self.policy_state = plan.scaler_state, plan.policy_state
        self.iteration += 1
        self._events.append(("done", -1))
        held = self._held_report(plan.report)
        report = EngineStepReport(**{f.name: getattr(held, f.name) for f in fields(StepReport)},
                                  events=tuple(self._events), executor=self.executor_name, iteration=self.iteration)
        if isinstance(self.executor, ThreadExecutor):
            self.executor.submit(BlockOp(next(self._seq), "commit_all"))
        # This step's gradients (borrowed from autograd: about the model's size) are released in
        # zero_grad, on this thread, where torch.optim's zero_grad(set_to_none=True) releases them.
        # Released on the worker right after the step instead, glibc gave their memory back to the
        # system and the next backward faulted every page of its new gradients in again (6000 page
        # faults, backward 15 -> 24 ms in benchmarks/overlap.py). glibc's heuristics still return
        # large freed blocks for some sizes and orders; README "Performance notes" has the fix.
        self._stale_grads = self._grads
        self._reset_step()
        return report

    def _publish_to_model(self, blocks: Sequence[int], presents: Sequence[tuple[bool, ...]]) -> None:
        """Give the model the new masters of the stepped ``blocks``: point each parameter at the publish
        buffer the executor wrote (no copy), or copy where nothing was published."""
        copy: list[int] = []
        swapped: list[torch.Tensor] = []
        with torch.no_grad():
            for b in blocks:
                mask = self._published[b]
                if mask is None:
                    copy.append(b)
                    continue
                layout, t = self.layouts[b], self.tensors[b]
                for slot, (i, has) in enumerate(zip(layout.param_indices, presents[b])):
                    if not has:
                        continue
                    p, k = self.params[i], mask[slot]
                    if k < 0:
                        view = t.master[layout.span(slot)]
                        p.copy_(view.view(p.shape))
                        continue
                    buffer = self._pub_shaped[i][k]
                    if p.stride() != buffer.stride():
                        # The model gave the parameter another layout since (model.to(memory_format=...), p.data
                        # = t): keep it, as torch.optim's in-place update does; the buffer is contiguous.
                        p.copy_(buffer)
                        continue
                    p.data = buffer
                    self._cur[i] = k
                    swapped.append(p)
        if swapped:
            torch.autograd.graph.increment_version(swapped)  # as the in-place update of torch.optim
        self._copy_to_model(copy, presents)

    def _copy_to_model(self, blocks: Sequence[int], presents: Sequence[tuple[bool, ...]]) -> None:
        with torch.no_grad():
            for b in blocks:
                layout, t = self.layouts[b], self.tensors[b]
                for view, i, has in zip(t.views(t.master, layout), layout.param_indices, presents[b]):
                    if has:
                        p = self.params[i]
                        p.copy_(view.view(p.shape))

    def _note_expected(self) -> None:
        """Start the step's arrivals over (none came yet) expecting a gradient of the parameters that require grad
        now. :meth:`_reset_step` took them at the end of the last step, so a parameter frozen since (after
        ``zero_grad()``, before the backward) was still expected: its block was not ready without it, and
        ``missing_grad="zero"`` stepped it with a zero gradient, where one frozen before ``zero_grad()`` was not."""
        self.tracker.reset([p.requires_grad for p in self.params])

    def _stepped(self, b: int, arrived: Sequence[bool]) -> tuple[bool, ...]:
        """Which parameters of block ``b`` a step steps: those with a gradient, and with a zero one (their
        slice kept zero by :meth:`_zero_absent`) the expected ones with ``missing_grad="zero"`` and those whose
        gradient ``zero_grad(set_to_none=False)`` zeroed -- torch steps those too, frozen or not."""
        zero_mode = self.speculation.missing_grad == "zero"
        expected = self.tracker.expected_in(b)
        return tuple(a or self._zero_grads[i] or (zero_mode and e)
                     for a, e, i in zip(arrived, expected, self.layouts[b].param_indices))

    def _note_gradients(self) -> None:
        """Remember the parameters that got a gradient this step (see :meth:`discard_gradients`)."""
        for i, n in enumerate(self.tracker.arrivals):
            if n > 0:
                self._had_grad[i] = True

    def discard_gradients(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (``zero_grad``); speculative steps already taken are undone.

        ``set_to_none=False`` follows ``torch.optim``: a parameter that has had a gradient keeps a zero one,
        so later steps step it (with a zero gradient) when it gets none; ``True`` (torch's default) forgets
        that too. Under ``ddp`` a step dropped after the ranks' exchange at its backward makes the next backward
        compare the ranks' states (:meth:`~sofx.offload.ddp.ReplicaWatch.drop_step`).
        """
        self._check_usable()
        with self._exclusive("zero_grad()"), self._interrupts:  # the speculative steps are undone whole
            self._discard_gradients(set_to_none)

    def _discard_gradients(self, set_to_none: bool) -> None:
        if set_to_none:
            self._had_grad = [False] * len(self.params)
        else:
            self._note_gradients()
        self._zero_grads = list(self._had_grad)
        self._stale_grads = None  # the last step's gradients (see step())
        for p in self.params:
            p.grad = None
        if self.tracker.started:
            self._record(self._wait())  # speculative steps (and decisions) still running
            for b, was in enumerate(self._speculated):
                if was:
                    self._run_now(BlockOp(next(self._seq), "undo_now", b), self.layouts[b])
            # Always: a late gradient's undo_now left its block's (used) record in the runner too.
            self.executor.submit(BlockOp(next(self._seq), "commit_all"))
            self.device_runner.run(BlockOp(next(self._seq), "commit_all"))
            self._record(self._wait())
        if self._replicas is not None:
            self._replicas.drop_step()  # (the other ranks may have taken it: the next backward compares)
        self._reset_step()

    @property
    def micro_steps(self) -> int:
        """The backward calls (micro-steps of ``gradient_accumulation_steps``) that gave this step gradients
        (:mod:`sofx.offload.backward_passes`; under ``ddp`` the synchronized ones, those ``no_sync()`` runs give
        DDP's parameters none). Where a gradient came from outside any backward, the count of the gradient
        arrivals of the parameter that had the most, if higher."""
        if self.passes.untracked:
            return max(self.passes.count, self.tracker.micro_steps)
        return self.passes.count

    @property
    def in_step(self) -> bool:
        """Whether gradients of an unfinished step are held (between backward and ``step()``)."""
        return self.tracker.started

    @property
    def interrupts(self) -> Any:
        """``with engine.interrupts:`` holds Ctrl-C back (:mod:`sofx.offload.interrupts`; nothing where the engine
        has no gate), for a caller whose own bookkeeping goes with an engine call: raised as that ends, it
        would find the call done and the bookkeeping not (the facade's ``last_report`` of a step taken)."""
        return self._interrupts

    # ------------------------------------------------------------ state
    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def state_dict(self) -> dict[str, Any]:
        """The engine's complete state: a plain pytree of tensors and JSON-able values.

        See :mod:`sofx.offload.engine_state`. ``blocks[i]`` holds block
        ``i``'s ``master`` (fp32), ``exp_avg``, ``exp_avg_sq`` and
        per-parameter ``counts`` (the live tensors, not copies: snapshot them
        before the next step if you keep them). Must be called between
        steps. After an executor failure it still returns what is in memory
        (the shared tensors survive a dead worker), marked
        ``"complete": False``: blocks of the failed step may be partly stepped.
        After :meth:`close` it returns the state the engine kept (what ``opt.state[p]`` shows; a ``with opt:``
        loop saves after the block), marked ``"complete": False`` where the close left block operations unfinished
        (a worker that did not stop within the timeout); refused where it was closed between backward and
        ``step()``.
        """
        with self._exclusive("state_dict()", closed_ok=True):
            self._refuse_shared_read_in_fork("state_dict()")
            if self._closed:
                self._check_kept_state("state_dict()")
            complete = self._failed is None and self._kept_state is None
            if complete:
                # Between backward and step() (also mid-accumulation, or with nothing speculated): the held
                # gradients are not in the state, and blocks may hold speculative steps not validated yet.
                self._check_between_steps("state_dict()")
                if not self._closed:  # (close() recorded the last operations)
                    self._wait_all()
                self._adopt_model_edits()  # the saved masters are what the model holds
            return engine_state_dict(self, complete)

    def _refuse_shared_read_in_fork(self, what: str) -> None:
        """Refuse ``what`` (a read of the state) in a child forked from the process that made this engine while its
        blocks were in shared memory (the process executor's, until :meth:`close` copies them out): the parent goes
        on stepping them, so the child read neither the state at the fork (as a forked child reads the in-process
        executors' copy-on-write state: a fork-based asynchronous checkpoint) nor one whole."""
        if self._pid == os.getpid() or self._closed or not isinstance(self._cpu_arena, SharedMemoryArena):
            return
        raise SofxError(f"{what} in process {os.getpid()}, forked from process {self._pid}, which made this "
                        "optimizer: its process executor keeps the state in shared memory that process goes on "
                        "stepping, so what this one read would be neither the state at the fork nor whole; take the "
                        f"state dict in process {self._pid} before forking (a copy: copy.deepcopy of it), or use the "
                        "thread executor, whose state a forked child reads as it was at the fork")

    def _check_kept_state(self, what: str) -> None:
        """Refuse ``what`` (a read of the state a closed engine kept) where the close dropped it (interpreter exit,
        collection) or came between backward and ``step()`` (the blocks may hold speculative steps never validated,
        and no ``step()`` nor ``zero_grad()`` can come)."""
        if self._kept_state == _STATE_DROPPED:
            raise SofxError(f"{what}: the optimizer was closed at interpreter exit (or as it was collected), "
                            "dropping its state")
        if self._kept_state == _STATE_MID_STEP:
            raise SofxError(f"{what} was called on an optimizer closed between backward and step(): its blocks may "
                            "hold speculative steps that were never validated, so the state it kept is neither the "
                            "one before the step nor the one after it; close it after step() or zero_grad() to save "
                            "its state")

    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def load_state_dict(self, state: dict[str, Any], where: str = "state") -> None:
        """Restore :meth:`state_dict`'s output (checked whole first: nothing changes on a mismatch, the error
        names the entry as ``where`` + its keys); the masters are copied into the model's parameters."""
        self._check_usable()
        with self._exclusive("load_state_dict()"):
            self._check_state_change("load_state_dict()")
            self._refuse_short_params(range(len(self.params)))  # (the masters are copied into them)
            self._wait_all()
            load_engine_state(self, state, where)
            self._state_changed(CONTENT_KEYS)
            self._copy_to_model([b.index for b in self.layouts], [(True,) * len(b.numels) for b in self.layouts])
            self._note_versions()
            self._snapshot_needs.forget()  # learnt on other moments
            self._reset_step()

    @contextlib.contextmanager
    def _exclusive(self, what: str, closed_ok: bool = False) -> Iterator[None]:
        """``what`` (a public call that waits for the executor, or reads or changes the step or the state) while no
        other such call runs: one in another thread at the same time is refused (two step()s took one step and
        counted two; a wait() took a step's results), and :meth:`close` waits for it. ``closed_ok``: ``what`` is
        allowed on a closed engine (a read of the state it keeps). Ctrl-C is held back (sofx.offload.interrupts)
        from before the lock is taken: raised between taking it and the ``try`` that releases it, it kept the lock
        for good (every later call refused). A read allowed on a closed engine carries out a close a second Ctrl-C
        dropped (:meth:`_deferred_close_dropped`; the other calls do in :meth:`_check_usable`) first: done as it
        ends, the process executor's live views it returned were of the shared memory the close copies the state
        out of."""
        if closed_ok and self._close_pending:
            self._deferred_close_dropped()
        with self._interrupts:
            gate, since = self._interrupts, section_breaks(self._interrupts)
            if not self._call_lock.acquire(blocking=False):
                inside = self._call_what
                if self._call_owner == threading.get_ident() and inside is not None:  # (close() too: a signal
                    # handler inside it was told the optimizer is "being closed by another thread")
                    raise SofxError(f"{what} was called inside {inside} on the same thread (a signal handler, which "
                                    "Python runs between any two lines of the main thread, or a hook called from "
                                    f"it): the optimizer's calls do not nest; call it after {inside} returns (e.g. "
                                    "set a flag in the handler and act on it in the training loop)")
                self._refuse_while_closing(what)
                raise SofxError(f"{what} was called while another thread is in step(), zero_grad(), wait() or a "
                                "state call (state_dict(), load_state_dict(), opt.state, reload_params()) of this "
                                "optimizer; call them from one thread at a time")
            self._call_owner, self._call_what = threading.get_ident(), what
            try:
                self._refuse_while_closing(what)
                if self._closed and not closed_ok:  # (by another thread, since the caller checked)
                    raise SofxError("the optimizer is closed")
                yield
            finally:
                try:  # (first: a second Ctrl-C in here kept the lock for good, every later call refused)
                    self._call_owner = self._call_what = None
                    self._note_break_surely(gate, since, what)
                    if self._close_pending:  # close() was called on this thread meanwhile (a signal handler)
                        with self._hook_lock:
                            self._close(keep_state=True)
                finally:
                    self._call_lock.release()

    def _note_break(self, gate: Any, since: int | None, what: str) -> None:
        """Stop the engine for good where ``what`` (a call or a gradient hook, which entered ``gate``'s section when
        it had passed ``since`` signals on: :func:`~sofx.offload.interrupts.section_breaks`) was broken into by a
        second Ctrl-C: its bookkeeping may be half done (a result taken and not counted, a block stepped and still
        marked speculative), and a later ``zero_grad()`` or ``step()`` would go on from it without a word."""
        if since is None or section_breaks(gate) == since or self._failed is not None:
            return
        self._failed = SofxError(f"{what} was interrupted by a second Ctrl-C (the first is held back until the "
                                 "optimizer's state is whole again, a second goes through at once), which left its "
                                 "state changed in part: neither step() nor zero_grad() can tell what it left")

    def _note_break_surely(self, gate: Any, since: int | None, what: str) -> None:
        """:meth:`_note_break` as a section ends, where a second Ctrl-C may break into that check itself (the first
        still held back): it is noted all the same (once the interrupt was raised, the count has moved), and raised
        on."""
        try:
            self._note_break(gate, since, what)
        except BaseException:
            self._note_break(gate, since, what)
            raise

    def _refuse_while_closing(self, what: str) -> None:
        if self._closing:
            raise SofxError(f"{what} was called while the optimizer is being closed by another thread (close() "
                            "waits for the call that runs, then closes it)")

    def param_state(self, index: int) -> dict[str, torch.Tensor]:
        """torch.optim-style state of parameter ``index``: ``step`` (0-d int64), ``exp_avg``, ``exp_avg_sq``,
        ``master``: live views of the block's tensors (an in-place change, e.g. ``zero_()``, is the state's).
        Refused between backward and ``step()``: blocks may hold speculative steps then (torch.optim would show
        the state before the step), and a change would be mixed into them (after an executor failure in the
        middle of a step, when no ``step()`` nor ``zero_grad()`` can come, naming the failure); and while another
        thread is in a call that holds the engine (see :meth:`_exclusive`). Readable after :meth:`close` (the
        state it keeps; not where the interpreter's exit closed it with the process executor, which drops the
        state then)."""
        with self._exclusive("opt.state[p]", closed_ok=True):
            self._refuse_shared_read_in_fork("opt.state[p]")
            if self._kept_state == _STATE_DROPPED:  # (its blocks are gone: a KeyError)
                self._check_kept_state("opt.state[p]")
            if self.in_step and self._failed is not None:  # (no step() nor zero_grad() can come: name it)
                raise ExecutorError(f"opt.state[p] cannot be read: the offload engine failed in the middle of a step "
                                    f"({self._failed}), so its blocks may be partly stepped; state_dict() returns "
                                    "what is in memory, marked \"complete\": False; load a checkpoint saved between "
                                    "steps to continue training") from self._failed
            if self.in_step and self._closed:  # (no step() or zero_grad() can come: say what the state holds)
                raise SofxError("opt.state[p] was read from an optimizer closed between backward and step(): its "
                                "blocks may hold speculative steps that were never validated, so the state it kept "
                                "is neither the one before the step nor the one after it; close it after step() or "
                                "zero_grad() to read its state")
            if self.in_step:
                raise SofxError("opt.state[p] was read between backward and step(): blocks may hold speculative "
                                "steps that are not validated yet (torch.optim would show the state before the "
                                "step), and a change would mix into them; read it after step() or zero_grad()")
            return self._param_views(index)

    def _param_views(self, index: int) -> dict[str, torch.Tensor]:
        """:meth:`param_state` without its checks (between steps, inside a call that holds the engine)."""
        block, slot = self.tracker.where[index]
        layout, t = self.layouts[block], self.tensors[block]
        shape = self.params[index].shape
        sl = layout.span(slot)
        views = (t.counts[slot], t.exp_avg[sl].view(shape), t.exp_avg_sq[sl].view(shape), t.master[sl].view(shape))
        return dict(zip(PARAM_STATE_KEYS, views))

    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def set_param_state(self, index: int, key: str, value: Any) -> None:
        """Write ``value`` into parameter ``index``'s ``key`` of :meth:`param_state` (between steps; checked
        first, as :meth:`load_state_dict` checks a state: nothing changes on a bad value). A ``master`` is also
        given to the model's parameter at once (see :meth:`_show_master`)."""
        self._check_usable()
        with self._exclusive(f"opt.state[p][{key!r}] = ..."):
            self._check_state_change(f"changing the optimizer state ({key!r})")
            self._set_param_state(index, key, value)

    def set_param_states(self, index: int, values: Any, what: str = "opt.state[p] = ...",
                         partial: bool = False) -> None:
        """Replace parameter ``index``'s state by ``values`` (``opt.state[p] = {...}``, torch.optim's way to set a
        parameter's whole state): torch.optim's entry (``step``, ``exp_avg``, ``exp_avg_sq``; a ``master`` too,
        kept where not given), or an empty mapping: the parameter starts afresh (step 0, zero moments), as
        torch.optim's next step after ``opt.state[p] = {}``. ``partial``: the keys given only, the others kept
        (``opt.state[p].update(...)``; an empty mapping changes nothing). Every value is checked as
        :meth:`set_param_state` checks it before any is written: nothing changes on a bad one. ``what``: the call,
        for the errors."""
        self.set_params_states([(index, values)], what, partial)

    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def set_params_states(self, entries: Sequence[tuple[int, Any]], what: str, partial: bool = False) -> None:
        """:meth:`set_param_states` of several parameters (``opt.state.update({p: {...}, q: {...}})``): every
        entry is checked before any is written (a bad one for ``q`` left ``p``'s written)."""
        for index, values in entries:
            if not isinstance(values, Mapping):
                raise UnsupportedError(f"{what} (parameter {index}): expected a mapping of a parameter's state "
                                       f"('step', 'exp_avg', 'exp_avg_sq', as torch.optim's), got "
                                       f"{type(values).__name__}")
        self._check_usable()
        with self._exclusive(what):
            self._check_state_change(f"changing the optimizer state ({what})")
            checked = [(index, self._checked_param_states(index, values, f"{what} (parameter {index})", partial))
                       for index, values in entries]
            checked = self._read_before_written(checked)
            for index, values in checked:
                for key in PARAM_STATE_KEYS:
                    if key in values:
                        self._set_param_state(index, key, values[key])

    def _read_before_written(self, checked: list[tuple[int, Mapping[Any, Any]]]) -> list[tuple[int, dict]]:
        """The values of :meth:`set_params_states`' entries, copied where they lie in storage that the call writes
        (another parameter's state, or another key's of the same one: ``opt.state.update({q: {}, p: {"exp_avg":
        opt.state[q]["exp_avg"], ...}})``, a swap of two moments), so that no write changes a value still to be
        written: p took q's state already reset, a swap copied one moment over the other and back. Where a master
        is written (shown to its model parameter at once), a value on that parameter's storage is copied too (a
        swap of two layers' weights, ``{p: {..., "master": q.detach()}, q: {..., "master": p.detach()}}``).
        The storages written are those of the entries' own views (a block's flat tensors, the parameters whose
        master is given), not every block's and parameter's: a loop writing each parameter's state in turn was
        quadratic in the parameters."""
        written: set[int] = set()
        for index, values in checked:
            views = self._param_views(index)
            written.update(views[key].untyped_storage().data_ptr() for key in values if key in views)
            if "master" in values:
                written.add(self.params[index].untyped_storage().data_ptr())
        return [(index, {key: value.clone() if isinstance(value, torch.Tensor)
                         and value.untyped_storage().data_ptr() in written else value
                         for key, value in values.items()})
                for index, values in checked]

    def _checked_param_states(self, index: int, values: Mapping[Any, Any], where: str,
                              partial: bool) -> Mapping[Any, Any]:
        """``values`` for :meth:`set_params_states` (``{}``, not ``partial``: the fresh state), every value checked
        as :meth:`set_param_state` checks it; nothing is written."""
        views = self._param_views(index)
        if not values and not partial:
            values = {"step": 0, "exp_avg": torch.zeros_like(views["exp_avg"]),
                      "exp_avg_sq": torch.zeros_like(views["exp_avg_sq"])}
        unknown = sorted(repr(k) for k in values if not (isinstance(k, str) and k in views))
        missing = [] if partial else [k for k in PARAM_STATE_KEYS[:3] if k not in values]
        if unknown or missing:
            problems = [f"{k!r} missing" for k in missing] + ([f"unknown {', '.join(unknown)}"] if unknown else [])
            raise UnsupportedError(f"{where}: {'; '.join(problems)}: a parameter's state has "
                                   f"{list(PARAM_STATE_KEYS)} ('master' kept where not given)")
        for key, value in values.items():
            if key == "step":
                self._state_count(index, value, views[key])
            else:
                self._check_param_state_value(index, key, value, views[key])
        if "master" in values:
            self._refuse_short_params([index])
        return values

    @staticmethod
    def _state_count(index: int, value: Any, target: torch.Tensor) -> int:
        """``value`` as parameter ``index``'s step count (a whole number that ``target``'s dtype holds)."""
        count = _whole_number(value, torch.iinfo(target.dtype).max, f"parameter {index}'s state['step']",
                              UnsupportedError)
        if count is None:
            raise UnsupportedError(f"state['step'] of parameter {index} must be a whole number >= 0 (at most "
                                   f"{torch.iinfo(target.dtype).max}), got {value!r}")
        return count

    def _set_param_state(self, index: int, key: str, value: Any) -> None:
        views = self._param_views(index)
        if key not in views:
            raise UnsupportedError(f"optimizer state key {key!r}; a parameter's state has {sorted(views)}")
        target = views[key]
        if key == "step":
            count = self._state_count(index, value, target)
            self._wait_all()
            target.fill_(count)
            self._state_changed()
            return
        self._check_param_state_value(index, key, value, target)
        if key == "master":  # (given to the model's parameter too)
            self._refuse_short_params([index])
        self._wait_all()
        with torch.no_grad():
            target.copy_(value)
        self._state_changed((key,))
        if key == "master":
            self._show_master(index)

    def _show_master(self, index: int) -> None:
        """Give the model's parameter ``index`` its master (rounded to the parameter's dtype), as
        :meth:`load_state_dict` gives it every master, and note its version: a forward pass before the next step
        uses the weights that step starts from (the model kept its old values until then). The parameter is
        written in place, in the publish buffer it holds now; other parameters' edits stay to be adopted, and so
        does other storage given to this one since (``p.data = t``: refused at the next step where it is of
        another kind, see :meth:`_take_params_as_masters`)."""
        block, slot = self.tracker.where[index]
        p = self.params[index]
        with torch.no_grad():  # (as _copy_to_model for this parameter alone: its one view, not the block's)
            p.copy_(self.tensors[block].master[self.layouts[block].span(slot)].view(p.shape))
        self._versions[index] = (self.params[index]._version, self._versions[index][1])

    @staticmethod
    def _check_param_state_value(index: int, key: str, value: Any, target: torch.Tensor) -> None:
        """``value`` can be written into parameter ``index``'s ``key`` (``target``): a floating-point tensor of its
        shape (of any float dtype and device: ``copy_`` casts it, as torch users set moments of the parameter's
        dtype) that :meth:`load_state_dict` would take -- dense, with data, no negative second moment
        (:func:`~sofx.offload.engine_state.check_dense`, :func:`~sofx.offload.engine_state.check_nonnegative`;
        a nan or an inf loads, as a diverged run's state) -- with no finite value that the cast makes inf
        (:func:`~sofx.stored_values.refuse_beyond`)."""
        where = f"parameter {index}'s state[{key!r}]"
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            check_dense(value, where, UnsupportedError)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() \
                or tuple(value.shape) != tuple(target.shape):
            # (a tensor's dtype named: an int64 one of the right shape read "got Tensor (3, 5)")
            got = _described(value) if isinstance(value, torch.Tensor) else \
                f"{article(type(value).__name__)} {value!r:.60}"
            raise UnsupportedError(f"state[{key!r}] of parameter {index} must be a float tensor of shape "
                                   f"{tuple(target.shape)}, got {got}")
        check_nonnegative(value.detach(), key, where, UnsupportedError)
        refuse_beyond(value.detach(), target.dtype, where, "the state's dtype", UnsupportedError)

    @without_grad  # (a second Ctrl-C in a torch.no_grad() of its copies left grad mode off)
    def reset_state(self) -> None:
        """Forget the Adam state (moments and step counts of every parameter; the masters are kept): the next
        step is every parameter's first, as in ``torch.optim`` after ``opt.state = defaultdict(dict)``."""
        self._check_usable()
        with self._exclusive("reset_state() (opt.state = {})"):
            self._check_state_change("resetting the optimizer state")
            self._reset_state()

    def _reset_state(self) -> None:
        self._wait_all()
        with torch.no_grad():
            for t in self.tensors.values():
                t.exp_avg.zero_()
                t.exp_avg_sq.zero_()
                t.counts.zero_()
        self._state_changed(("exp_avg", "exp_avg_sq"))
        self._eligibility_memo = [None] * len(self.layouts)
        self._snapshot_needs.forget()

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the executor, remove the hooks and release shared memory (idempotent). The state stays readable
        (``opt.state[p]``, :meth:`state_dict`): the process executor's blocks are copied out of shared memory first.

        Safe beside other threads: a ``step()``, ``zero_grad()``, ``wait()``, state call (``state_dict()``,
        ``load_state_dict()``, ``opt.state``, ``reload_params()``) or gradient hook running in another thread is
        waited for (it completes whole; such calls made meanwhile are refused). Called inside one of them
        on the same thread -- a signal handler, which Python runs in the main thread between any two bytecodes,
        also inside ``step()`` -- it cannot wait for it: the close is done as that call ends (where a second Ctrl-C
        breaks into that call as it ends, before the close, the next call does it, and is refused as closed; or the
        next gradient hook, which then takes nothing)."""
        if self._closed and not self._close_unfinished:
            return
        me = threading.get_ident()
        if me in (self._call_owner, self._hook_owner):
            inside = self._call_what if me == self._call_owner else None
            self._close_pending = inside or "a gradient hook (during backward)"
            return
        with self._interrupts:
            self._closing = True
            try:
                with self._call_lock, self._hook_lock:
                    # (a signal handler's close() in here: deferred; its other calls refused, naming close())
                    self._call_owner, self._call_what = threading.get_ident(), "close()"
                    try:
                        self._close(keep_state=True)
                    finally:
                        self._call_owner = self._call_what = None
            finally:
                self._closing = False

    def _close_for_exit(self) -> None:
        """:meth:`close` at interpreter exit (``keep_state=False``). The exit handlers run while daemon threads still
        run: a call or gradient hook running in one is waited for as :meth:`close` waits for it (it completes whole;
        such calls made meanwhile are refused), but at most ``min(timeout, EXIT_WAIT_S)`` seconds in all: past that
        the engine is closed under it all the same (the process must exit and the executor's worker stop), with a
        ``RuntimeWarning`` naming the call, which then fails in its thread if that thread still gets to run. A
        worker process is then given as long again to finish what was queued, and killed after that (the state is
        dropped); a worker thread as long, and left running after that, with a warning naming its operation."""
        if self._closed and not self._close_unfinished:
            return
        waited = min(self.timeout, EXIT_WAIT_S)
        deadline = time.monotonic() + waited
        self._closing = True
        call = hook = False
        try:
            call = self._call_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            hook = self._hook_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            if not (call and hook):
                what = self._call_what if not call else "a gradient hook"
                warnings.warn(f"sofx.offload: at interpreter exit, {what or 'a call'} was still running in another "
                              f"thread after {waited:g} s (EXIT_WAIT_S, or the optimizer's timeout); the optimizer "
                              "is closed under it, and it fails there", RuntimeWarning, stacklevel=2)
            if call:  # (a signal handler's close() in here: deferred; its other calls refused, naming close())
                self._call_owner, self._call_what = threading.get_ident(), "close()"
            self._close(keep_state=False)
        finally:
            if call:
                self._call_owner = self._call_what = None
                self._call_lock.release()
            if hook:
                self._hook_lock.release()
            self._closing = False

    def _deferred_close_dropped(self) -> str:
        """Carry out a deferred :meth:`close` that the call it was deferred to did not (a second Ctrl-C broke into
        that call's end, before the close: the optimizer stayed open, its executor running, and the next call went
        on, or was told the engine failed and to close it); returns the call it was deferred to, else "". Nothing is
        done while a call or gradient hook holds the engine (one in another thread does the close as it ends), nor
        while a close is under way (a call from a signal handler inside ``close()``, which holds the call lock before
        it notes itself as its owner: that call's close waited for its own thread's lock for good)."""
        inside = self._close_pending
        if not inside or self._closed or self._closing or self._call_owner is not None or self._hook_owner is not None:
            return ""
        self.close()
        return inside

    def _close_if_free(self) -> None:
        """Carry out a deferred :meth:`close` at the end of a gradient hook's section (the hook lock held), unless a
        call holds the engine: it closes it as it ends."""
        if self._call_lock.acquire(blocking=False):
            try:
                self._close(keep_state=True)
            finally:
                self._call_lock.release()

    def _close(self, keep_state: bool) -> None:
        """:meth:`close`; ``keep_state=False`` (the engine is being collected, the interpreter exits): the shared
        blocks are dropped without a copy. A close broken into before it stopped the executor (a second Ctrl-C as it
        removed the hooks or waited for the worker) is finished by the next: the rest of :meth:`_stop`, the
        executor's close not waiting again (a worker process is killed)."""
        if self._closed and not self._close_unfinished:
            return
        if self._close_unfinished:
            self._stop(keep_state)
            return
        self._closed = True
        self._close_unfinished = True  # (until _stop ends)
        dropped = not keep_state and isinstance(self._cpu_arena, SharedMemoryArena)
        if dropped:  # (see _unmap_shared_blocks)
            self._kept_state = _STATE_DROPPED
        elif self.in_step and self._failed is None:  # (a failed engine's state is read as before the close)
            self._kept_state = _STATE_MID_STEP
        try:
            self._stop(keep_state)
        finally:
            # Parameters using shared-memory publish buffers move to private memory; the files are closed.
            try:
                self._release_shared_memory()
                self._unmap_shared_blocks(keep_state)
            finally:
                release_gate(self._interrupts)
                self._interrupts = NO_GATE

    def _stop(self, keep_state: bool) -> None:
        """:meth:`_close`'s work that may be done again (where a second Ctrl-C broke into it): remove the hooks,
        stop the executor and record what it ran; ``_close_unfinished`` is cleared once it is all done."""
        try:
            atexit.unregister(getattr(self, "_close_at_exit", None))
            self.hooks.remove()
            if self._route is not None:
                self._route.unbind(self)
            self._stale_grads = None
            if not keep_state and not isinstance(self.executor, InlineExecutor):
                # (nothing reads the blocks again: a worker that does not answer is not waited for long, where the
                # exit, or a garbage collection, waited the optimizer's timeout for it; a worker process is killed
                # then, a worker thread, which cannot be, is left to finish alone, with the close's warning)
                self.executor.close(timeout=min(self.timeout, EXIT_WAIT_S))
            else:
                self.executor.close()
            self._record_at_close()
        except BaseException:
            # (a second Ctrl-C while the executor's close waited for its worker: the state kept is not whole where
            # operations were left)
            if self.executor.pending and self._kept_state is None:
                self._kept_state = (f"its close() was interrupted with {self.executor.pending} block operation(s) "
                                    "unfinished")
            raise
        self._close_unfinished = False

    def _record_at_close(self) -> None:
        """Record the results of the operations the executor ran as it closed (the thread executor's last
        ``commit_all``, which ``step()`` queues and does not wait for); where it left some unfinished (a worker that
        did not stop within the timeout, where one still running may change its blocks; a killed worker process),
        note in ``_kept_state`` that the state kept is not whole (unless :meth:`_close` noted why already: closed
        between backward and ``step()``, or the state dropped)."""
        self._record(self.executor.poll())  # (the process executor's: received before its connection closed)
        lost = self.executor.pending
        if lost and self._kept_state is None:
            self._kept_state = (f"closed with {lost} block operation(s) unfinished (its worker did not stop in "
                                "time, or was killed)")

    def _unmap_shared_blocks(self, keep_state: bool) -> None:
        """Drop every reference to the shared-memory tensors (the worker has stopped), so that their memory goes
        back to ``/dev/shm`` now: the files have no name nor open descriptor, and these mappings held the space
        for as long as the closed optimizer lived on (a notebook variable, a scheduler), where the next
        optimizer's space check found it taken. ``keep_state``: each block's master, moments and counts are
        copied into private memory first, one block at a time (what the in-process executors keep after close)."""
        if not isinstance(self._cpu_arena, SharedMemoryArena):
            return
        for layout in self.layouts:
            b = layout.index
            if layout.on_device or b not in self.tensors:
                continue
            t = self.tensors.pop(b)
            self._grad_views[b] = ()
            self._grads[b] = [None] * len(layout.numels)
            if keep_state:
                self.tensors[b] = BlockTensors(master=t.master.clone(), exp_avg=t.exp_avg.clone(),
                                               exp_avg_sq=t.exp_avg_sq.clone(), grad=t.grad.new_empty(0),
                                               counts=t.counts.clone())
            del t
        self._pub.clear()
        self._pub_shaped.clear()

    def __del__(self) -> None:  # best effort: the worker thread/process and /dev/shm files
        # Without the locks: no thread can be in a call or hook of an engine being collected (its frame holds a
        # reference to it), so nothing runs that close() would wait for.
        try:
            self._close(keep_state=False)
        except Exception:
            pass


def _check_float32_hparams(actions: Sequence[BlockAction], stepped: Sequence[bool]) -> None:
    """Refuse (an :class:`~sofx.errors.HParamError` naming ``blocks[i]``, in :meth:`sofx.Adam.update`'s words for a
    float32 leaf: :func:`~sofx.adam.check_float32_range`) the validation hparams of a block the step would step
    (``stepped``: a parameter of it is stepped, :meth:`OffloadEngine._stepped`; also on a step that overflows, as
    :func:`sofx.serial.serial_step` checks them) that its fp32 masters cannot hold: an lr or weight_decay beyond
    float32's largest value, an eps that is 0 there. :func:`~sofx.speculate.plan_validation` checks their values,
    not this range (its blocks may be float64): the block's step raised in the executor as the plan was applied,
    the blocks before it stepped, and the engine stopped for good. Checked before anything is applied."""
    checked: set[AdamHParams] = set()  # (the blocks of one group hold the same values: checked once)
    for action, used in zip(actions, stepped):
        if used and action.hparams not in checked:
            check_float32_range(action.hparams, "hparams for ", f"blocks[{action.block}]")
            checked.add(action.hparams)


def _grad_mark(grad: torch.Tensor | None) -> tuple[weakref.ReferenceType, int, int] | None:
    """What tells ``grad`` (a ``.grad``) from what it may become: the tensor (held weakly), its version counter
    and its storage; ``None`` for no gradient."""
    return None if grad is None else (weakref.ref(grad), grad._version, grad.data_ptr())


def _close_if_alive(engine: weakref.ReferenceType[OffloadEngine]) -> None:
    """At interpreter exit: close the engine if it still lives (best effort, as ``__del__``; waiting a moment for a
    call that runs in another thread, see :meth:`OffloadEngine._close_for_exit`)."""
    alive = engine()
    if alive is not None:
        try:
            alive._close_for_exit()
        except Exception:
            pass
