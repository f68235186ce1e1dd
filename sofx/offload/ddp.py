"""Gradients averaged by ``DistributedDataParallel``, taken as each bucket's all-reduce completes.

Under ``torch.nn.parallel.DistributedDataParallel`` autograd's accumulation hook sees a rank's *local*
gradient: DDP's reducer copies it into a bucket, all-reduces the bucket, and at the end of backward writes the
average into ``.grad`` (a parameter ``find_unused_parameters`` or ``static_graph`` finds unused on every rank
keeps its ``.grad`` as it was: ``None`` after ``zero_grad()``). The engine's own hooks, which take the gradient
out of ``.grad`` as autograd accumulates it, would take the local one, and leave DDP nothing to average.

So for the parameters a DDP module reduces the engine registers no hook: a DDP communication hook
(``register_comm_hook``, which a DDP module takes once) does DDP's reduction itself -- each rank's gradient
times ``1 / world_size``, summed by ``all_reduce``: the bits of DDP's reduction without a hook -- and, as
each bucket's all-reduce completes (during backward), hands its parameters' averaged gradients to the engine
(:meth:`~sofx.offload.engine.OffloadEngine.take_reduced_gradient`): blocks are speculated on the gradients
DDP writes while backward goes on. ``.grad`` accumulates in autograd as with ``torch.optim`` (``no_sync()``
micro-steps included), so an averaged gradient is the step's gradient so far: a later synchronized backward
of the same step replaces it. What the engine refuses as it takes a gradient (an invalid hparam, read when the
step's first block is ready) does not fail the hook: DDP still gets every reduced bucket, on every rank, and
the engine raises its error out of backward once DDP has written ``.grad``, as its gradient hooks do without
DDP. Under ``ddp.join()`` (uneven inputs) a rank out of inputs only all-reduces; ``join()`` dividing by the ranks
left (``divide_by_initial_world_size=False``, which DDP tells no hook) is refused where it is made.

The hook's state is a :class:`DDPRoute`, one per DDP module (an attribute of the module): an optimizer created again
over the same DDP module takes the route over (the older one refuses to step from then on, as with
gradient hooks), and a closed or collected optimizer leaves DDP's plain all-reduce -- once every rank's is: until
then its rank takes part in the ranks' exchanges, saying so, and the others' ``step()`` raises, naming it.

DDP compares the replicas' parameters at its construction only; the optimizer states are the engine's to keep the
same: a :class:`ReplicaWatch` per engine notes each call that changes its state, and at each synchronized backward
the hook has every rank take part in one tiny all-reduce (before its bucket 0's, the first), by which the ranks decide
together whether to compare their states, and where they decided so, compare them right after it, every rank at the
same point (:func:`check_replicas`): ``step()`` raises what differs, on every rank, entering no collective.

An optimizer made without ``ddp`` over parameters a DDP module averages is refused
(:func:`refuse_averaged`): at construction, and at its first backward where the model was wrapped after it
was made. The DDP modules are found among the objects the garbage collector tracks (a parameter does not
know the modules that hold it), only where a process group is initialized (a DDP module needs one): one pass
over them, about 20 ms per 100,000 objects.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import weakref
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch

from sofx.errors import SofxError, UnsupportedError

if TYPE_CHECKING:
    from sofx.offload.engine import OffloadEngine

__all__ = ["CONTENT_KEYS", "USED_HPARAMS", "DDPRoute", "Decision", "ReplicaWatch", "check_replicas", "ddp_route",
           "failed_exchange_error", "reduced_indices", "refuse_averaged", "unmatched_step_error"]

# The attribute of a DDP module holding its route (the route goes with the module; it holds no reference to it)
_ROUTE_ATTRIBUTE = "_sofx_ddp_route"


class DDPRoute:
    """Where one DDP module's averaged gradients go: the engine that takes them (held weakly) and its index of
    each of the module's parameters it steps. ``bucket_view``: the module's ``gradient_as_bucket_view`` (where it is
    off, no ``.grad`` is a view of a bucket, and :func:`_scale_for_average` reads no parameter)."""

    def __init__(self, group: Any, world_size: int, *, bucket_view: bool = True) -> None:
        self.group = group
        self.world_size = world_size
        self.bucket_view = bucket_view
        self._engine: weakref.ReferenceType[OffloadEngine] | None = None
        self._index: dict[int, int] = {}  # id(parameter) -> the engine's index of it
        self._closed = False  # the engine was closed, and another rank's may still take part in the exchanges
        self.rebuilt = False  # whether the DDP module had rebuilt its buckets at its last forward (_after_forward)
        # id(parameter) -> where its .grad was as autograd last accumulated into it (_note_accumulated): for the
        # module's parameters the engine does not step (another optimizer's), which _scale_for_average reads
        self._accumulated: dict[int, int] = {}

    def owner(self) -> OffloadEngine | None:
        """The engine taking the gradients now (``None``: none, or it was collected)."""
        return self._engine() if self._engine is not None else None

    def bind(self, engine: OffloadEngine, index: Mapping[int, int]) -> None:
        """Send the gradients of the parameters in ``index`` (``id(param) -> engine index``) to ``engine``;
        an engine that took them before is superseded (it refuses to step from then on)."""
        older = self.owner()
        if older is not None and older is not engine:
            older.hooks.supersede(next(iter(older.reduced), -1))
        self._engine, self._index, self._closed = weakref.ref(engine), dict(index), False

    def unbind(self, engine: OffloadEngine) -> None:
        """Stop sending gradients to ``engine`` (closed), if it is the one taking them: this rank takes part in
        the exchanges as closed until every rank's optimizer is (:meth:`_closed_exchange`)."""
        if self.owner() is engine:
            self._engine, self._index, self._closed = None, {}, True

    def _gone(self) -> bool:
        """Whether this rank's engine was closed, or collected without ``close()``, and the ranks still exchange."""
        return self._closed or (self._engine is not None and self._engine() is None)

    def _closed_exchange(self) -> None:
        """This rank's part in the ranks' exchange (:meth:`ReplicaWatch.exchange`) at bucket 0 of a synchronized
        backward (its own or, joined, the others'), its optimizer closed or collected: it says so (the others'
        ``step()`` raises, naming this rank: stepping alone, they would diverge from it), and once no rank's
        optimizer is live, every rank leaves the exchanges at this same one (DDP's plain all-reduce from then on).
        Without it the others' exchange met this rank's all-reduce of its bucket: gloo aborted the process on the
        mismatched sizes (or, sizes alike, each took the other's bits)."""
        rank = torch.distributed.get_rank(self.group)
        got = _exchange(self.group, [0, 0, 0, 0, 0, *(_NEUTRAL,) * 4, rank + 1, 0])
        if not got[_LIVE]:
            self._engine, self._closed = None, False

    def take(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Hand a reduced bucket's averaged gradients to the engine (those of parameters it steps)."""
        engine = self.owner()
        if engine is None:
            return
        for p, g in zip(params, grads):
            index = self._index.get(id(p))
            if index is not None:
                engine.take_reduced_gradient(index, g)

    def begin_bucket(self, index: int, last: bool) -> None:
        """Bucket ``index`` of a synchronized backward comes to the hook (on the thread running backward; ``last``:
        the last of the backward's buckets). DDP's reducer all-reduces the buckets in index order, so bucket 0 is
        the first of each synchronized backward on every rank, and a rank that joined shadows it first
        (:meth:`shadow_bucket`): there the engine starts taking the backward's gradients, and the ranks make their
        exchange (:meth:`~sofx.offload.engine.OffloadEngine.begin_reduced_backward`). At the last, :meth:`_end` is
        queued to run once DDP has written ``.grad`` (see :func:`_queue_after_ddp`). Both once per synchronized
        backward, not per autograd backward: reentrant checkpointing runs backwards of its own inside it (a joined
        rank shadows it once: the mismatched exchanges aborted gloo; and the end of a nested one raised the engine's
        error before DDP's reduction was done: that rank's backward stopped with buckets left to all-reduce)."""
        engine = self.owner()
        if index == 0 and engine is not None:
            _exchanging(engine.begin_reduced_backward)
        elif index == 0 and self._gone():
            _exchanging(self._closed_exchange)
        if last:
            _queue_after_ddp(self._end)

    def shadow_bucket(self, index: int) -> None:
        """A rank that joined (``DDP.join()``) shadows bucket ``index`` of the others' synchronized backward: at bucket
        0 (as the others' :meth:`begin_bucket`), its engine takes part in their exchange
        (:meth:`ReplicaWatch.exchange`)."""
        engine = self.owner()
        if index == 0 and engine is not None:
            _exchanging(engine.shadow_reduced_backward)
        elif index == 0 and self._gone():
            _exchanging(self._closed_exchange)

    def _end(self) -> None:
        """The end of a backward, after DDP's: the engine raises what it refused during it (see
        :meth:`~sofx.offload.engine.OffloadEngine.end_reduced_backward`)."""
        engine = self.owner()
        if engine is not None:
            engine.end_reduced_backward()


def _exchanging(exchange: Any) -> None:
    """``exchange()``, the ranks' exchange at bucket 0 of a synchronized backward (and the comparison it decides):
    where its collective fails (gloo's bare ``RuntimeError``: a rank that never came to this backward, within the
    process group's timeout), a :class:`SofxError` naming it and the likely causes, gloo's error its cause; an error
    that names no missing rank (no timeout or closed connection) is torch's words, no rank blamed."""
    try:
        exchange()
    except SofxError:
        raise
    except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
        from sofx.distributed.groups import _collective_failure, _lost_rank

        if not _lost_rank(exc):  # (an error every rank meets at the call: torch's words, no rank blamed)
            raise _collective_failure("backward under DDP", exc, "the ranks' exchange at this synchronized backward",
                                      "nothing was stepped") from exc
        raise SofxError("backward under DDP: a rank did not take part in the ranks' exchange at this synchronized "
                        f"backward ({type(exc).__name__}: {exc}) within the process group's timeout (or it exited); "
                        "likely causes: a rank that raised in its own code before its backward, or skipped it (every "
                        "rank must run each synchronized backward, as DDP requires); nothing was stepped, and the "
                        "process group may be unusable now (gloo closes its connections on a timeout)") from exc


def _queue_after_ddp(callback: Any) -> None:
    """Run ``callback`` at the end of the running backward, after DDP's own end of it (the reducer waits for every
    bucket's all-reduce and writes ``.grad``). Called from the last bucket's hook: DDP queues its end as a final
    callback of the running autograd backward (the outer one under reentrant checkpointing, or a nested one) right
    after that hook launched the all-reduce: a callback queued now runs before it, and queues ``callback``, which then
    runs after it (autograd runs the callbacks queued while it runs them, in order)."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(lambda: queue(callback))


def _in_backward() -> bool:
    """Whether the hook was called by a backward (autograd's, or its final callbacks: ``static_graph`` reduces
    there); not: a rank that ran out of inputs under ``DDP.join()`` shadows the all-reduce of the others."""
    return torch._C._current_graph_task_id() >= 0


def _scale_for_average(route: DDPRoute, bucket: Any) -> None:
    """Scale ``bucket``'s gradients (in its buffer) by ``1 / world_size`` as DDP's reducer does without a hook: it
    multiplies a gradient by ``1 / world_size`` as it copies it into the bucket, but divides by ``world_size`` in
    place a ``.grad`` that is its bucket view already (``gradient_as_bucket_view``: made so at an earlier
    synchronized backward of the step, autograd accumulating into it since). Where the world size is no power of
    two the two differ in the last bit (a third of the elements, 3 ranks): multiplying them all, the second
    synchronized backward of an accumulation was not DDP's average. Such a ``.grad`` is the tensor DDP left at the
    end of the step's last synchronized backward (the engine's :meth:`~sofx.offload.engine.OffloadEngine.
    grad_kept_since_reduced`) and a view of this bucket: none where the DDP module makes no bucket views
    (``route.bucket_view`` false), whose buffer is multiplied at once, its parameters not read.

    A parameter of the module the engine does not step (another optimizer's: a ``torch.optim`` optimizer that
    keeps its ``.grad`` through ``zero_grad(set_to_none=False)``, or two synchronized backwards before its step) is
    divided where autograd accumulated into its bucket view in this backward (:func:`_note_accumulated`, before
    DDP's copy), or, given no gradient since the last synchronized backward (unused: ``find_unused_parameters``),
    where its ``.grad`` is its bucket view (multiplied always, its average was not DDP's in the last bit on 3
    ranks). So is every parameter once the engine is closed or collected (DDP then averages for ``torch.optim``
    as without a hook; the hook stays: DDP takes no hook back)."""
    buffer, world = bucket.buffer(), route.world_size
    engine = route.owner()
    # (x * (1 / 2**k) is x / 2**k; without bucket views DDP copies every .grad)
    if world & (world - 1) == 0 or not route.bucket_view:
        buffer.mul_(1.0 / world)
        return
    views = bucket.gradients()
    divided = []
    for p, view in zip(bucket.parameters(), views):
        # (a closed or collected engine steps none: every parameter is as another optimizer's)
        index, grad = route._index.get(id(p)) if engine is not None else None, p.grad
        if index is None:  # (another optimizer's: where autograd accumulated, else where DDP found its .grad)
            noted = route._accumulated.pop(id(p), None)
            divided.append(view.data_ptr() == (noted if noted is not None else
                                               grad.data_ptr() if grad is not None else None))
            continue
        divided.append(grad is not None and grad.data_ptr() == view.data_ptr()
                       and engine.grad_kept_since_reduced(index))
    if not any(divided):
        buffer.mul_(1.0 / world)
        return
    for view, divide in zip(views, divided):
        view.div_(world) if divide else view.mul_(1.0 / world)


def _all_reduce_then_take(route, bucket):  # (unannotated: DDP compares a hook's annotations with its own classes)
    """The communication hook: DDP's reduction of ``bucket`` (its gradients times ``1 / world_size``, summed over
    the ranks, in place), then its averaged gradients to ``route``'s engine, on the thread that completes it.

    The reduced bucket is what the hook's future holds however the engine takes the gradients: DDP's reducer
    waits for it at the end of backward, on every rank, and writes ``.grad`` from it. What the engine refuses
    (an hparam read when the step's first block is ready, ...) it raises itself at the end of backward, after
    DDP's end of it (:meth:`DDPRoute.begin_bucket`): an error in the future reached the user as DDP's
    ``RuntimeError("Got the following error when running the callback: ...")`` instead.

    Under ``DDP.join()`` a rank out of inputs calls the hook outside backward with a bucket of zeros, to match the
    all-reduce of the others: it all-reduces, and hands the engine nothing (the rank has no step, as torch.optim
    on it has none; given the others' averages, its engine was left in a step)."""
    buffer = bucket.buffer()
    _scale_for_average(route, bucket)
    mine = _in_backward()  # (not: the zeros of a joined rank, whose optimizer has no step, as torch's)
    if mine:
        route.begin_bucket(bucket.index(), bucket.is_last())
    else:
        route.shadow_bucket(bucket.index())
    work = torch.distributed.all_reduce(buffer, group=route.group, async_op=True)

    def take(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if mine:
            route.take(bucket.parameters(), bucket.gradients())  # (views of the reduced buffer)
        return reduced

    return work.get_future().then(take)


_REPLICAS_HINT = ("the optimizer states must be the same on every rank, as the replicas are (DDP compares the "
                  "parameters at its construction only; each rank would step its own state, and the replicas "
                  "diverge): change the state the same way on every rank (load the same state_dict on every rank, "
                  "or none on any; the same opt.state assignments; the same hparams and opt.speculate); nothing "
                  "was stepped: call zero_grad(), make the ranks' states the same, and step again")

# The keys whose contents a comparison digests where a rank changed them (the step counts are always compared)
CONTENT_KEYS = ("exp_avg", "exp_avg_sq", "master")
# (a digest left out -- a joined rank's, or of hparams it has not -- which MAX ignores)
_NEUTRAL = torch.iinfo(torch.int64).min
# The entry naming the hparams each rank's last step() used, where they differ (see ReplicaWatch)
USED_HPARAMS = ("the hparams the last step() used (set after the ranks' exchange at its synchronized backward: "
                "unseen by the other ranks, and the replicas diverged at that step)")


class Decision(NamedTuple):
    """Whether the ranks compare their optimizer states at this step, the keys whose contents they digest,
    where the hparams the ranks' last steps used differ (an hparam set on a rank alone after the last step's
    exchange), this rank's (its text, compared too: ``None`` where it is not compared), and whether a rank shadowed
    the others' backwards under ``DDP.join()`` since the ranks last compared (a difference found names the join)."""

    compare: bool
    contents: tuple[str, ...]
    used: str | None = None
    joined: bool = False


class ReplicaWatch:
    """Under DDP: what of this rank's optimizer state changed since the ranks last compared theirs, and what the
    ranks decided and found together about the step under way.

    Every call that changes the state (construction, ``load_state_dict``, an ``opt.state[p][key]`` assignment,
    ``opt.state = {}``, ``reload_params``, ``opt.speculate`` set to another value) bumps :attr:`generation`
    (:meth:`changed`, naming the keys whose contents changed; a step count is always compared), and so does a step
    dropped after the ranks' exchange at it (:meth:`drop_step`: ``zero_grad()`` on a rank that skipped a ``step()`` the
    others may have taken). At each synchronized backward (in the communication hook, before the all-reduce of its
    bucket 0, the first: before any block is ready; once however many autograd backwards reentrant checkpointing runs
    inside it) -- or in ``step()``, where the step had none -- every rank takes part in one all-reduce (MAX) of 11 int64
    (:meth:`exchange`): whether its generation moved since the last comparison, which contents changed, whether it
    joined (``DDP.join()``: 2 where it shadows the others' backward, and no rank compares; 1 where it shadowed one
    since the ranks last agreed, which an error found names), a digest of its hparams and minus it, a digest of
    the hparams its last ``step()`` used (:meth:`stepped`) and minus it, and, its optimizer closed (or collected),
    its rank plus one (else 0: a closed rank takes part in the exchanges, :meth:`DDPRoute._closed_exchange`, and the
    others' ``step()`` raises, naming it), or 1 where its optimizer is live. Where a rank's generation moved or the
    hparams differ, all ranks compare their states right after it, at the same point (:func:`check_replicas`; at
    backward the outcome is kept, :meth:`compared`, and ``step()`` raises the error on every rank: it enters no
    collective); not while a rank has joined (it takes no step: the comparison waits for a step of every rank). A
    rank that changed its state alone so makes every rank compare: none enters a collective alone.

    An hparam set on a rank alone between a synchronized backward and ``step()`` (after the exchange) is stepped
    unseen by the others: the replicas diverge at that step. The next exchange finds it, one step late: the hparams
    the ranks' last steps used differ; every rank then counts its whole state as changed (each content: the masters
    and moments differ from that step on), compares it and the hparams each rank's last step used, and raises at
    its ``step()``, naming them, until the ranks' states are the same again (the same ``state_dict`` loaded on every
    rank). The same hparam set on every rank between backward and ``step()`` (a warmup) is stepped as set."""

    def __init__(self, route: DDPRoute) -> None:
        self.route = route
        self.generation, self.compared_at = 1, 0  # (construction: compared at the first step)
        self.contents: set[str] = set()  # the keys whose contents changed since the last comparison
        self.decision: Decision | None = None  # this step's latest exchange's (None: no exchange yet)
        self.error: SofxError | None = None  # what this step's comparison found (None: nothing differs)
        self.used: str | None = None  # the hparams of this rank's last step() since the last exchange (None: none)
        self.shadowed = False  # this rank shadowed a backward under DDP.join() since the ranks last agreed
        self.failed: BaseException | None = None  # what the ranks' exchange at this step's backward raised
        self.failed_comparing = False  # whether the comparison it decided raised it, not the exchange

    def changed(self, contents: Sequence[str] = ()) -> None:
        """This rank's state changed (``contents``: the keys of :data:`CONTENT_KEYS` whose values it changed)."""
        self.generation += 1
        self.contents.update(contents)

    def stepped(self, hparams: str | None) -> None:
        """This rank's ``step()`` was taken with ``hparams`` (text; ``None``: unreadable now): sent in the next
        exchange, where the ranks' last steps' hparams are compared."""
        self.used = hparams

    def exchange(self, hparams: str | None, joined: bool = False) -> None:
        """The ranks' exchange (see the class docstring), this rank's hparams being ``hparams`` (text; ``None``:
        refused, the rank's own error, which its step raises: its digest is left out); its decision is this
        step's from then on. Where the step's comparison found a difference already, it decides none (every rank
        found it, and every step() raises it: no comparison twice for nothing, at the synchronized backwards of an
        accumulation). A ``joined`` rank (its shadow of a backward) only takes part. The hparams of the last
        ``step()`` (:meth:`stepped`) are sent once (a rank without a step since leaves them out); where they differ
        between the ranks, every rank's whole state counts as changed, and the ranks compare."""
        dirty = self.generation != self.compared_at
        digest = (_NEUTRAL, _NEUTRAL) if hparams is None or joined else _digest_bounds(hparams)
        used = self.used
        used_digest = (_NEUTRAL, _NEUTRAL) if used is None or joined else _digest_bounds(used)
        flags = [0, 0, 0, 0, 2, *digest, *used_digest, 0, 1] if joined else \
            [int(dirty), *(int(key in self.contents) for key in CONTENT_KEYS), int(self.shadowed or joined), *digest,
             *used_digest, 0, 1]
        got = _exchange(self.route.group, flags)  # (where it raises, nothing of the watch changed)
        self.used, self.shadowed = None, self.shadowed or joined
        if joined:
            return
        moved, *changed, joins, high, minus_low, used_high, used_minus_low, closed, _ = got
        if closed:  # (a rank whose optimizer is closed takes no step, nor part in a comparison)
            self.error = self.error or _closed_error(closed - 1)
            self.decision = Decision(False, ())
            return
        diverged = _differ(used_high, used_minus_low)
        if diverged:  # (every rank: the masters and moments differ from the last step on; compared until the same)
            self.changed(CONTENT_KEYS)
            changed = [1] * len(CONTENT_KEYS)
        # (joins: 2 where a rank shadows this backward, and none compares; 1 where one did since the last agreement)
        compare = joins < 2 and bool(moved or diverged or _differ(high, minus_low)) and self.error is None
        self.decision = Decision(compare, tuple(key for key, flag in zip(CONTENT_KEYS, changed) if flag),
                                 used if diverged else None, joins == 1)

    @property
    def holds_speculation(self) -> bool:
        """Whether no block may be speculated now: the step's decision is not made yet, its comparison is still
        to come, or it found the states differ (the step raises)."""
        return self.decision is None or self.decision.compare or self.error is not None

    def compared(self, error: SofxError | None, whole: bool = True) -> None:
        """The ranks compared their states as decided: ``error``, where they differ (this step's, raised by its
        ``step()``), else nothing differs; ``whole``: every entry was compared (not only the hparams and the loss
        scaler, at a later backward of the step: see
        :meth:`~sofx.offload.engine.OffloadEngine.begin_reduced_backward`), so the state is the others' as of
        now (a join since the last comparison is then forgotten)."""
        if error is not None:
            self.error = error
        elif whole:
            self.compared_at = self.generation
            self.contents.clear()
            self.shadowed = False
        self.decision = self.decision._replace(compare=False, used=None)

    def fail(self, exc: BaseException, comparing: bool = False) -> None:
        """The ranks' exchange (``comparing``: the comparison it decided) at a synchronized backward of this step
        raised ``exc`` here (a rank never came to it within the process group's timeout: it raised in its own code
        before its backward; or an interrupt): DDP's reduction of that backward did not complete, and the group may
        be unusable. ``step()`` raises it at once (:meth:`failure_error`), entering no collective (its own exchange,
        without a decision, waited the group's timeout again where the backend keeps its connections), until the
        step is dropped; the next exchange compares the states (the ranks may have parted anywhere)."""
        self.failed, self.failed_comparing = exc, comparing
        self.changed()

    def failure_error(self) -> SofxError:
        """The error of a ``step()`` after :meth:`fail`, naming the exchange or the comparison that raised."""
        assert self.failed is not None
        return failed_exchange_error(self.failed, self.failed_comparing)

    def drop_step(self) -> None:
        """This rank drops the step (``zero_grad()`` before ``step()``): where the ranks had exchanged at it, the
        others may have taken it (a rank that raised between backward and ``step()`` and skipped it), so the
        state counts as changed: the next exchange compares (the step counts then differ, named)."""
        if self.decision is not None:
            self.changed()
        self.forget_step()

    def forget_step(self) -> None:
        """The step ended (or was dropped): the next one decides anew."""
        self.decision, self.error, self.failed, self.failed_comparing = None, None, None, False


_LIVE = 10  # (the slot of the exchange saying whether a rank's optimizer is live: see ReplicaWatch.exchange)


def _exchange(group: Any, flags: list[int]) -> list[int]:
    """The ranks' exchange: ``flags`` (11 int64, :meth:`ReplicaWatch.exchange`) all-reduced with MAX over ``group``,
    on its device."""
    from sofx.distributed.groups import _collective_device

    got = torch.tensor(flags, dtype=torch.int64, device=_collective_device(group, None))
    torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MAX, group=group)
    return got.tolist()


def _closed_error(rank: int) -> SofxError:
    """The error of a live rank's ``step()`` where rank ``rank``'s optimizer (the highest such) is closed."""
    return SofxError(f"step() under DDP: the optimizer of rank {rank} over this DDP module is closed (or was collected "
                     "without close()), and that rank takes no step: stepping the others alone would diverge the "
                     "replicas; nothing was stepped: close the optimizer on every rank (DDP then averages for "
                     "torch.optim, as without a hook), or make a new one over the DDP module on every rank (from "
                     "the same state_dict)")


def unmatched_step_error(exc: BaseException) -> SofxError:
    """The error of a ``step()`` without a synchronized backward whose exchange (:meth:`ReplicaWatch.exchange`, a
    collective of that ``step()``) failed with ``exc``: a rank did not take part in it within the process group's
    timeout (gloo's ``RuntimeError``), naming the likely causes; an error that names no missing rank (no timeout
    or closed connection) is torch's words, no rank blamed."""
    from sofx.distributed.groups import _collective_failure, _lost_rank

    if not _lost_rank(exc):
        return _collective_failure("step() under DDP without a synchronized backward", exc,
                                   "the ranks' exchange of this step()", "nothing was stepped")
    return SofxError("step() under DDP without a synchronized backward (every backward of the step under no_sync(), "
                     "or none) is a collective: a rank did not take part in the ranks' exchange of this step() within "
                     f"the process group's timeout ({type(exc).__name__}: {exc}); likely causes: a rank whose "
                     "optimizer over this DDP module is closed (or was collected without close()), a rank that skipped "
                     "this step() (a zero_grad() before it, or an extra step(), on one rank only), a rank out of "
                     "inputs under DDP.join(); nothing was "
                     "stepped, and the process group may be unusable now (gloo closes its connections on a timeout): "
                     "call step() at the same points on every rank, with the optimizer open on every rank, or end "
                     "each step with a synchronized backward (the last micro-step outside no_sync()), whose exchange "
                     "a closed rank takes part in")


def failed_exchange_error(exc: BaseException, comparing: bool = False) -> SofxError:
    """The error of a ``step()`` whose synchronized backward's exchange with the other ranks (``comparing``: the
    comparison of the states it decided) raised ``exc`` (:meth:`ReplicaWatch.fail`)."""
    what, cause = (("the ranks' comparison of their optimizer states", "a rank whose comparison raised (an "
                    "interrupt, its own error) or that never came to it")
                   if comparing else
                   ("the ranks' exchange", "a rank that raised in its own code before its backward, or skipped it"))
    return SofxError(f"step() under DDP: {what} at this step's synchronized backward failed "
                     f"({type(exc).__name__}: {exc}), so DDP's reduction of that backward did not complete (this "
                     "rank's gradients are not the ranks' average) and the process group may be unusable now (gloo "
                     "closes its connections on a timeout; DDP then refuses the next backward); nothing was stepped, "
                     f"and this step() entered no collective; likely cause: {cause}. Restart the ranks from the last "
                     "checkpoint (as torchrun --max-restarts does), or, where the group still works, call zero_grad() "
                     "on every rank and run the step's backwards again")


def _differ(high: int, minus_low: int) -> bool:
    """Whether the ranks' digests all-reduced by :meth:`ReplicaWatch.exchange` (the max, and minus the min) differ;
    not where every rank left its digest out (neutral)."""
    return high != _NEUTRAL and high != -minus_low


def _digest_bounds(text: str) -> tuple[int, int]:
    """A 56-bit digest of ``text`` and minus it: all-reduced with MAX, the max and minus the min, which agree
    exactly where every rank's digest does (as :func:`sofx.distributed.agreement._digests_agree`)."""
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    return digest, -digest


_JOIN_HINT = ("a rank ran out of inputs under DDP.join() (it shadowed the others' synchronized backwards) since the "
              "ranks last compared their optimizer states: its optimizer took no step at those backwards, the others' "
              "did, and their states differ (torch.optim's replicas diverge there silently); give every rank the same "
              "number of batches (a DistributedSampler with drop_last=True), or after the join load the same "
              "state_dict on every rank: that of the last rank to join, which stepped at every backward "
              "(torch.distributed.broadcast_object_list([opt.state_dict()], src=that rank)); ")


def check_replicas(route: DDPRoute, entries: Mapping[str, str], joined: bool = False) -> None:
    """Raise the same :class:`~sofx.errors.SofxError` on every rank of ``route``'s process group unless every rank
    passed the same ``entries`` (name -> text: each block's step counts, the hparams, the loss scaler, the digests
    of the contents a rank changed; see :func:`sofx.offload.engine_state.replica_entries`), naming the first that
    differs and each rank's value.

    :func:`sofx.distributed.agreement._agree`: one all-reduce of two int64 (a digest of the entries) on the group's
    device (CUDA for NCCL, else the CPU); only where the digests differ an ``all_gather_object`` of the entries, to
    name what differs. Every rank must call it at the same point: right after :class:`ReplicaWatch`'s exchange
    decided so (at a synchronized backward, or in a ``step()`` without one), on every rank. ``joined``: a rank
    shadowed backwards under ``DDP.join()`` since the ranks last compared (the error says so, and what to do)."""
    from sofx.distributed.agreement import _agree
    from sofx.distributed.groups import _collective_device

    _agree("step() under DDP", dict(entries), route.group, _collective_device(route.group, None), None,
           (_JOIN_HINT if joined else "") + _REPLICAS_HINT)


def _check_ddp(ddp: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise UnsupportedError(f"ddp must be the torch.nn.parallel.DistributedDataParallel module whose gradients "
                               f"the optimizer steps (ddp=ddp_model), got {type(ddp).__name__}")


def _delayed(ddp: Any) -> set[int]:
    """The ids of the parameters whose all-reduce ``ddp`` delays (``delay_all_reduce_named_params``: DDP counts them
    among those it ignores, and all-reduces their gradients in one buffer of its own, outside the hook)."""
    return {id(p) for p in getattr(ddp, "_delay_all_reduce_params", None) or ()}


def _averaged(ddp: Any, params: Sequence[torch.Tensor]) -> frozenset[int]:
    """The indices of the ``params`` whose gradients ``ddp`` averages (its module's parameters but those it was
    told to ignore; those whose all-reduce it delays too)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    theirs = {id(p) for name, p in ddp.module.named_parameters() if name not in ignored} | _delayed(ddp)
    return frozenset(i for i, p in enumerate(params) if id(p) in theirs)


def reduced_indices(ddp: Any, params: Sequence[torch.Tensor]) -> frozenset[int]:
    """:func:`_averaged`, refused when empty, or holding a parameter whose all-reduce ``ddp`` delays (its gradient
    never comes to the hook, and the gradient hooks would take it before DDP averages it)."""
    _check_ddp(ddp)
    delayed = _delayed(ddp)
    for i, p in enumerate(params):
        if id(p) in delayed:
            raise UnsupportedError(f"parameter {i} (shape {tuple(p.shape)}) is one whose all-reduce ddp delays "
                                   "(delay_all_reduce_named_params): DDP all-reduces those after backward in a "
                                   "buffer of its own, outside the communication hook the optimizer takes the "
                                   "averaged gradients from; wrap the model without delay_all_reduce_named_params")
    indices = _averaged(ddp, params)
    if not indices:
        raise UnsupportedError(f"none of the optimizer's {len(params)} parameters is one whose gradient ddp "
                               f"averages ({type(ddp.module).__name__}'s parameters): pass ddp_model.parameters() "
                               "and the same ddp_model as ddp=")
    return indices


def ddp_route(ddp: Any) -> DDPRoute:
    """The route of ``ddp``: its communication hook is registered on first use (refused where ``ddp`` has one of
    its own already, a DDP module takes one: also where it was made with ``mixed_precision``, named then)."""
    _check_ddp(ddp)
    route = vars(ddp).get(_ROUTE_ATTRIBUTE)
    if route is not None:
        return route
    mixed = getattr(ddp, "mixed_precision", None)
    if mixed is not None:
        # (DDP registers a hook of its own for it, which upcasts the reduced gradients into the fp32 parameters)
        raise UnsupportedError(f"ddp was made with mixed_precision={mixed}: DDP then reduces the gradients in a "
                               "communication hook of its own, and the optimizer needs the hook to take the averaged "
                               "gradients as they come; wrap the model without mixed_precision: the optimizer keeps "
                               "fp32 masters itself, so train the model in that dtype (model.to(torch.bfloat16)) "
                               "or under torch.autocast")
    route = DDPRoute(ddp.process_group, torch.distributed.get_world_size(ddp.process_group),
                     bucket_view=bool(getattr(ddp, "gradient_as_bucket_view", True)))
    try:
        ddp.register_comm_hook(route, _all_reduce_then_take)
    except RuntimeError as exc:
        raise UnsupportedError(f"ddp has a communication hook already ({exc}); a DDP module takes one, and the "
                               "optimizer needs its own to take the averaged gradients as they come: wrap the model "
                               "in a DistributedDataParallel without a hook") from None
    # (an instance attribute over DDP's method, holding neither the module nor a cycle through it)
    ddp.join_hook = functools.partial(_join_hook, weakref.ref(ddp), route)
    route.rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
    ddp.register_forward_hook(functools.partial(_after_forward, route), always_call=True)
    if route.bucket_view and route.world_size & (route.world_size - 1):  # (what _scale_for_average reads)
        note = functools.partial(_note_accumulated, weakref.ref(route))
        for p in ddp.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(note)
    setattr(ddp, _ROUTE_ATTRIBUTE, route)
    return route


def _note_accumulated(route_ref: "weakref.ReferenceType[DDPRoute]", p: torch.Tensor) -> None:
    """A hook of autograd's accumulation into ``p.grad``, which runs before DDP's reducer sees the gradient: notes
    where ``p.grad`` is now (DDP then divides it in place where that is its bucket view: accumulated into the view
    that an earlier synchronized backward left, or copies it, :func:`_scale_for_average`). A route collected (its
    DDP module gone) notes nothing."""
    route = route_ref()
    if route is not None and p.grad is not None:
        route._accumulated[id(p)] = p.grad.data_ptr()


def _after_forward(route: DDPRoute, ddp: Any, args: Any, output: Any) -> None:
    """A forward hook of the DDP module (also where its forward raised): where DDP rebuilt its buckets in this
    forward (once, in the first forward in grad mode after the first synchronized backward; again after
    ``_update_process_group``), with ``gradient_as_bucket_view`` it moved every ``.grad`` into a view of the new
    buckets, the same values: the engine notes those as the gradients DDP left
    (:meth:`~sofx.offload.engine.OffloadEngine.note_rebuilt_grads`). Unnoted, a forward between backward and
    ``step()`` (a metric, in grad mode) at the first step made ``step()`` refuse a ``.grad`` "changed after
    backward", and a later synchronized backward of that step was scaled as a copied gradient (by ``1 /
    world_size``, where DDP divides a bucket view in place: the last bit of a third of the elements, 3 ranks)."""
    rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
    if rebuilt and not route.rebuilt and route.bucket_view:
        engine = route.owner()
        if engine is not None:
            engine.note_rebuilt_grads()
    route.rebuilt = rebuilt


def _join_hook(ddp_ref: "weakref.ReferenceType[Any]", route: DDPRoute, **kwargs: Any) -> Any:
    """DDP's join hook (made by ``ddp.join()`` and ``Join([ddp, ...])``, before any collective), refusing
    ``divide_by_initial_world_size=False`` while an optimizer takes the gradients: DDP's reducer then divides each
    gradient by the number of ranks with inputs left, which it tells no communication hook, and the hook divides
    by the world size (as DDP's own hooks do): the steps after a rank joined would differ silently."""
    ddp = ddp_ref()
    if not kwargs.get("divide_by_initial_world_size", True) and route.owner() is not None:
        raise UnsupportedError("ddp.join(divide_by_initial_world_size=False) (or Join with it) is not supported while "
                               "an optimizer made with ddp= takes the module's gradients: DDP would divide each "
                               "gradient by the number of ranks with inputs left, which it tells no communication "
                               "hook, and the optimizer's hook divides by the world size, as DDP's own hooks do; "
                               "use join() with divide_by_initial_world_size=True (the default)")
    return type(ddp).join_hook(ddp, **kwargs)


def _averaging_ddp(params: Sequence[torch.Tensor]) -> tuple[Any, int] | None:
    """A live DDP module averaging the gradient of one of ``params``, and the first such parameter's index."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        if not issubclass(type(obj), DistributedDataParallel):  # (type(): isinstance may run a proxy's __class__)
            continue
        module = vars(obj).get("_modules", {}).get("module")  # (none: a DDP module whose constructor failed)
        indices = _averaged(obj, params) if isinstance(module, torch.nn.Module) else frozenset()
        if indices:
            return obj, min(indices)
    return None


def refuse_averaged(params: Sequence[torch.Tensor], after: bool = False) -> None:
    """Refuse ``params`` of which one's gradient a DistributedDataParallel module averages, for an optimizer
    made without ``ddp`` (``after``: at its first backward, the model wrapped since): its gradient hooks would
    take each rank's local gradient before DDP averages it, and each rank would step its own (silently under
    ``find_unused_parameters``, where DDP leaves ``.grad`` alone), speculation on or off."""
    found = _averaging_ddp(params)
    if found is None:
        return
    ddp, i = found
    when = (" (the model was wrapped in it after the optimizer was made; make the optimizer after wrapping)"
            if after else "")
    raise UnsupportedError(
        f"parameter {i} (shape {tuple(params[i].shape)}) is one whose gradient a DistributedDataParallel module "
        f"({type(ddp.module).__name__}) averages{when}: the optimizer's gradient hooks would take each rank's "
        "local gradient before DDP averages it, and the replicas would diverge (speculation on or off); give the "
        "module to the optimizer, which then takes DDP's averages: SpeculativeAdamW(ddp_model.parameters(), ..., "
        "ddp=ddp_model)")
