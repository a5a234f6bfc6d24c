"""Training slots: the threads, and the working models, on which a simulated fleet trains.

A simulated fleet runs every virtual agent on its own thread (its MQTT traffic, its protocol
state), but at most ``[agents] train_slots`` of them train at once. :class:`TrainingSlots` runs
those trainings on ``train_slots`` threads of its own instead of on the agents' threads, and lends
each of its threads' models to the agents whose algorithm keeps no model of its own between rounds
(:attr:`edge_agent.algorithms.ClientAlgorithm.borrows_model`). Two measured costs make this worth it:

* **per-thread compute state.** A thread that has run torch training keeps about 2 MiB of
  per-thread state for as long as it lives (the math libraries' per-thread scratch buffers and
  caches, freed only when the thread exits) plus what it left in its own malloc arena. Measured
  with the light CNN on MNIST-shaped data (600 samples, one epoch, 1 torch thread): 50 threads that
  each trained once, one after another, and stayed alive held 240 MiB more than before (98 MiB of
  it in use, the rest free but not returned); the same 50 trainings on one thread held nothing
  more. With the training on the slots' threads that cost is paid per slot, not per agent.
* **a model per agent.** An agent whose algorithm loads the whole global model before each round
  (FedAvg and the other ``share = "all"`` methods) needs no model between rounds: a slot's working
  model serves every such agent in turn. An agent whose device model carries state of its own (a
  personalised head, local BatchNorm statistics, a model that never travels) keeps just those
  state entries as tensors and has them loaded into the working model for its round
  (:class:`edge_agent.agent.EdgeAgent`).

After each training the slot hands the freed heap back to the system (glibc's ``malloc_trim``,
:func:`release_free_heap`): a training's transient buffers (batches, activations, gradients, the
update's copy) are freed into whichever malloc arena the thread used, and without the trim the
fleet's peak RSS keeps them as free-but-held pages in every arena the agents' threads touched.

A real device (``fedfleet-agent``) runs one agent and trains on its own thread: no slots there.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import heapq
import itertools
import logging
import math
import sys
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import EdgeAgentError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SlotsClosed", "TrainingSlots", "release_free_heap"]

T = TypeVar("T")
log = logging.getLogger(__name__)


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)``, or None off glibc (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: musl has no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system: ``malloc_trim(0)`` over every malloc arena
    (glibc ≥ 2.8 walks them all and releases whole free pages inside them, not only the top).

    Returns:
        True when pages were released, False when none were or the C library has no
        ``malloc_trim`` (then nothing happens).
    """
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class SlotsClosed(EdgeAgentError):
    """The training slots were closed while a training waited for one (the run is ending)."""


class TrainingSlots:
    """``slots`` threads that run submitted trainings, each one at a time, the costliest waiting
    one first.

    A round's trainings arrive within milliseconds of each other and wait for a slot together, so
    the order they are served in decides the round's length: first come first served leaves the
    largest shard running alone at the end in some rounds and not others. Served largest first
    (``cost``: the training's samples × local epochs), the slots finish together: longest
    processing time first, whose makespan is within 4/3 − 1/(3·slots) of the best order's (Graham,
    "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969). Measured on the
    main job's Dirichlet(0.5) shards (10 clients on 2 slots, with the overlapped evaluation), by
    replaying the measured per-sample times in every arrival order: a 7.97 s mean round against
    8.21 s first come first served. Equal costs go in arrival order.

    Args:
        slots: the threads, i.e. the most trainings at once (>= 1).
        name: prefix of the threads' names.

    Raises:
        ValueError: ``slots`` < 1.
    """

    def __init__(self, slots: int, *, name: str = "train-slot") -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._local = threading.local()
        self._templates: dict[Hashable, torch.nn.Module] = {}
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        #: waiting work: (-cost, arrival number, future, work)
        self._queue: list[tuple[float, int, Future[Any], Callable[[], Any]]] = []
        self._arrivals = itertools.count()
        self._closed = False
        #: working models built so far (one per slot thread and architecture key)
        self.models_built = 0
        self._threads = [threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True) for i in range(slots)]
        for t in self._threads:
            t.start()

    def run(self, work: Callable[[], T], *, cost: float = 0.0) -> T:
        """Run ``work()`` on a slot thread and return what it returns (or raise what it raised);
        the calling thread waits meanwhile.

        Args:
            work: the training (no arguments).
            cost: its expected compute, in any unit shared by the callers (the agents use samples
                × local epochs); of the waiting work, the costliest runs first.

        Raises:
            SlotsClosed: the slots were closed before ``work`` could run.
        """
        future: Future[T] = self._submit(self._trimmed, work, cost)
        try:
            return future.result()
        except CancelledError:
            raise SlotsClosed("the training slots were closed before this training ran") from None

    def _submit(self, fn: Callable[..., T], arg: Any, cost: float) -> Future[T]:
        """Queue ``fn(arg)`` at priority ``cost``; its future.

        Raises:
            SlotsClosed: the slots are closed.
        """
        future: Future[T] = Future()
        with self._ready:
            if self._closed:
                raise SlotsClosed("the training slots are closed")
            heapq.heappush(self._queue, (-float(cost), next(self._arrivals), future, lambda: fn(arg)))
            self._ready.notify()
        return future

    def _serve(self) -> None:
        """A slot thread: its own (empty) set of working models, then the queue's costliest work,
        one at a time, until closed."""
        self._local.models = {}
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:  # closed and drained
                    return
                _, _, future, fn = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    @staticmethod
    def _trimmed(work: Callable[[], T]) -> T:
        """``work()``, then the freed heap returned to the system (:func:`release_free_heap`)."""
        try:
            return work()
        finally:
            release_free_heap()

    def on_slot(self) -> bool:
        """Whether the calling thread is one of the slots' threads."""
        return getattr(self._local, "models", None) is not None

    def offer_template(self, key: Hashable, model: torch.nn.Module) -> None:
        """Offer ``model`` as the template of architecture ``key``: the first one offered for a
        key is kept (the slots' working models of that key are copies of it); later ones are not
        (their owners drop them)."""
        with self._lock:
            self._templates.setdefault(key, model)

    def template(self, key: Hashable) -> torch.nn.Module:
        """The template of architecture ``key`` (to copy, never to train).

        Raises:
            KeyError: no template was offered for ``key``.
        """
        with self._lock:
            return self._templates[key]

    def working_model(self, key: Hashable) -> torch.nn.Module:
        """This slot thread's working model for architecture ``key``: a deep copy of its template
        (:meth:`offer_template`), made on the first call from this thread and reused by every
        later one. The caller loads what it needs into it: its state entries, training and
        ``requires_grad`` flags are whatever the last borrower left.

        Raises:
            RuntimeError: called from a thread that is not a slot's (the model would be shared
                with a training running at the same time).
            KeyError: no template was offered for ``key``.
        """
        if not self.on_slot():
            raise RuntimeError("working_model() is for the training slots' own threads")
        models: dict[Hashable, torch.nn.Module] = self._local.models
        model = models.get(key)
        if model is None:
            model = copy.deepcopy(self.template(key))
            for p in model.parameters():
                p.grad = None
            with self._lock:
                self.models_built += 1
            models[key] = model
        return model

    def close(self) -> None:
        """Let the trainings running now finish, refuse the waiting ones (:class:`SlotsClosed` in
        their callers) and end the threads. Idempotent."""
        with self._ready:
            self._closed = True
            waiting, self._queue = self._queue, []
            self._ready.notify_all()
        for _, _, future, _ in waiting:
            future.cancel()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def holder(self) -> SlotHold:
        """A reusable context manager that holds one slot while the calling thread works (the
        slot's thread waits idle meanwhile), so work done outside the slots counts against them:
        the server's evaluation during a simulated round (:class:`SlotHold`). It goes before
        every waiting training."""
        return SlotHold(self)

    def _occupy(self, started: threading.Event, release: threading.Event) -> Future[None]:
        """Queue, before every waiting training, a task that marks ``started`` and waits for
        ``release`` on a slot thread.

        Raises:
            SlotsClosed: the slots are closed.
        """
        def occupy(_: None) -> None:
            started.set()
            release.wait()

        return self._submit(occupy, None, math.inf)

    def __enter__(self) -> TrainingSlots:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SlotHold:
    """``with hold:`` waits for a free slot of ``slots`` and keeps it (its thread idle) until the
    block ends: at most ``slots.slots`` busy threads between the trainings and the holder.
    Reusable, one block at a time per thread.

    An entry interrupted while it waits (KeyboardInterrupt) withdraws its hold: no slot stays
    held by it, whether the hold had started on a slot thread or was still queued.

    Raises (on entry):
        SlotsClosed: the slots are closed, or were closed before a slot came free.
    """

    def __init__(self, slots: TrainingSlots) -> None:
        self.slots = slots
        self._local = threading.local()

    def __enter__(self) -> SlotHold:
        started, release = threading.Event(), threading.Event()
        future = self.slots._occupy(started, release)
        try:
            while not started.wait(0.05):
                if future.done():  # cancelled by close() before it ran
                    raise SlotsClosed("the training slots were closed before a slot came free")
        except BaseException:  # KeyboardInterrupt while it waited: the hold must never keep a slot
            release.set()  # a hold already running, or one that runs later, ends at once
            future.cancel()
            raise
        self._local.release = release
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._local.release.set()
