"""AsyncLLMEngine: the synchronous LLMEngine driven from its own thread beside an asyncio loop.

- The event loop (HTTP handlers) calls `submit`, which registers the request's `RequestStream`
  and returns it once the engine has admitted the request (or raises its rejection).
- The engine thread (`EngineWorker`, engine/engine_worker.py) drains a command queue between
  steps (add, abort, call, stop), runs `LLMEngine.step()`, and hands each step's outputs to the
  loop with one `call_soon_threadsafe`.
- Length prediction happens once per request, at admission, off the event loop, for the arrivals
  waiting at that moment in batches of at most `max_predict_batch` (engine/arrival_predictor.py):
  on the engine thread, one batch between two steps (default), or with `overlap_prediction` on a
  predictor thread.

Only the engine thread touches the LLMEngine; only the loop touches the stream table. A request
cancelled before the engine thread reaches it is skipped there, because its admission future is
cancelled and `set_running_or_notify_cancel` says so atomically. A request aborted while the
predictor thread still holds it is marked abandoned before the abort is queued (the abort may
reach the engine thread first and find nothing), and the engine thread refuses it on arrival.
An aborted id is free for a new request at once: until the engine thread reports the abort
applied, outputs under that id come from a step that still held the old request, and are dropped;
the aborted request's stream ends with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

# Re-exported: callers import the stream types from here.
from engine.async_stream import (EngineDead, EngineListener, EngineShuttingDown, EngineState,  # noqa: F401
                                 NullListener, RequestAborted, RequestStream, StreamEnd)
from engine.arrival_predictor import ArrivalPredictor
from engine.engine_commands import Abort, Call, Stop, Submission, refuse
from engine.engine_worker import EngineWorker
from predictor.base import Predictor
from scheduler.request import ChoiceGroup, SamplingParams, Tier

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A step (or a round of commands, or a prediction) running this long means a thread is stuck, which
# raises nothing: /health then fails, as for a dead engine. vLLM's v0 engine gave up after 60 s of
# one iteration; a first GPU step that compiles Triton kernels takes a while, hence more.
ENGINE_STALL_S = 180.0


class AsyncLLMEngine:
    def __init__(self, engine: Any, predictor: Predictor | None = None, *,
                 listener: EngineListener | None = None, max_predict_batch: int = 64,
                 overlap_prediction: bool = False, stall_s: float = ENGINE_STALL_S) -> None:
        self.engine = engine  # touched by the engine thread only, after start()
        self.stall_s = stall_s
        self.listener: EngineListener = listener or NullListener()
        # Through the attribute, not the object: attach_listener may replace it before start().
        self.predictor = None if predictor is None else ArrivalPredictor(
            predictor, lambda *latency: self._tell(self.listener.on_prediction, *latency), max_predict_batch)
        # Without overlap (the CPU default) the engine thread scores each drained group of arrivals
        # between steps: LightGBM's and torch's thread pools fighting over the same cores would
        # slow both. With overlap (a GPU engine) a predictor thread scores them during steps.
        self.overlap_prediction = overlap_prediction and predictor is not None
        self.state = EngineState.STOPPED
        # Reentrant: a stop signal's handler (begin_drain, on the main thread) may interrupt the
        # main thread while it holds the lock.
        self._state_lock = threading.RLock()
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._to_predict: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Aborts queued and not yet applied by the engine thread, per id (the loop's only). Until
        # then a step already under way may still report the aborted request, and its outputs
        # must not reach a later request that reuses the id.
        self._aborts_in_flight: dict[str, int] = {}
        # Submitted, not yet answered: written by the loop, looked up by `abort` from any thread.
        self._pending: dict[str, Submission] = {}
        self._no_streams = asyncio.Event()
        self._worker = EngineWorker(engine, self._commands, None if self.overlap_prediction else self.predictor,
                                    self._outputs_ready, self._engine_failed, self._abort_applied)
        self._threads: list[threading.Thread] = []

    def attach_listener(self, listener: EngineListener) -> None:
        """Report to `listener` from now on (the server's metrics, which read `stats` in turn, so
        they are built after this engine). Only before start(): the threads read it unlocked."""
        if self._threads:
            raise RuntimeError("attach the listener before the engine starts")
        self.listener = listener

    @property
    def policy(self) -> Any:
        """The scheduling policy the engine orders by."""
        return self.engine.scheduler.policy

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._threads:
            # Its engine thread's worker closed for good at the first shutdown: started again, it
            # refused every request (or every call) while /health read healthy.
            raise RuntimeError("an AsyncLLMEngine starts once: build a new one for another run")
        self._loop = asyncio.get_running_loop()
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self.state = EngineState.RUNNING
        workers = [("lengthwise-engine", self._worker.run)]
        if self.overlap_prediction:
            workers.append(("lengthwise-predictor",
                            lambda: self.predictor.run(self._to_predict, self._worker.offer, self._refuse_late)))
        self._threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in workers]
        for thread in self._threads:
            thread.start()

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones continue. Safe from any thread."""
        with self._state_lock:  # never over a FAILED the engine thread writes at the same moment
            if self.state is EngineState.RUNNING:
                self.state = EngineState.DRAINING

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; let in-flight ones finish for up to `grace_s`, then end the rest.

        A request still running at the deadline is aborted (its blocks freed at the next step) and
        its stream ends with finish_reason "abort", while the client's connection is still open:
        the HTTP server drains through this before it closes connections."""
        self.begin_drain()
        if self._no_streams.is_set():  # wait_for with a zero grace would time out even so
            return
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout=grace_s)
            return
        except asyncio.TimeoutError:
            logger.warning("aborting %d requests still running after %.1f s", len(self._streams), grace_s)
        for request_id, stream in list(self._streams.items()):
            stream.put(StreamEnd("abort", "the server shut down before the request finished"))
            pending = self._pending.get(request_id)
            admitted = pending is None or pending.was_admitted()
            self._abandon_and_abort(request_id, EngineShuttingDown())
            if admitted:  # one never admitted is refused by its submit, and counted there
                self._drop_aborted(request_id)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Drain (finish or abort in-flight requests within `grace_s`), then stop the threads."""
        await self.drain(grace_s)
        # The predictor goes first: it flushes what it holds into the command queue before Stop.
        self._to_predict.put(None)
        if self.overlap_prediction:
            await asyncio.to_thread(self._join_thread, self._threads[1], lambda: self.predictor.busy_since)
        self._commands.put(Stop())
        await asyncio.to_thread(self._join_thread, self._threads[0], lambda: self._worker.busy_since)
        for stream in list(self._streams.values()):
            stream.put(StreamEnd("abort", "the server shut down before the request finished"))
        self._streams.clear()
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    def _refuse_late(self, submission: Submission) -> None:
        """Answer a submission the predictor thread scored after the engine thread had ended (a
        shutdown left the stuck predictor behind): refused, as a queued command then is."""
        refuse(submission, self._closed_error())

    def _closed_error(self) -> Exception:
        """What a command the ended engine thread will never apply is answered with."""
        return EngineDead(self.failure) if self.failure else EngineShuttingDown()

    def _join_thread(self, thread: threading.Thread, busy_since: Callable[[], float | None]) -> None:
        """Wait for the thread to end. It is left behind (a daemon, so the process still ends) once
        it has stalled itself (`busy_since`, read each time: another thread's stall is no reason
        to give up on this one), or after `stall_s` in all."""
        deadline = time.monotonic() + self.stall_s
        while thread.is_alive():
            thread.join(timeout=0.05)
            stalled = self._stalled_for(busy_since()) is not None
            if thread.is_alive() and (stalled or time.monotonic() > deadline):
                logger.error("%s did not stop; leaving it behind", thread.name)
                return

    @property
    def stats(self) -> Any:
        """The engine's latest stats, as of the last step or command batch."""
        return self._worker.stats

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet admitted by the engine thread (waiting for the predictor
        or the thread's next round). The loop's to read."""
        return len(self._pending)

    @property
    def accepting(self) -> bool:
        return self.state is EngineState.RUNNING

    @property
    def healthy(self) -> bool:
        return self.accepting and self.stalled_s is None

    @property
    def stalled_s(self) -> float | None:
        """How long the step or round of commands under way (or, with overlap, the predictor
        thread's batch) has run, once that is past `stall_s`; None while both threads progress."""
        busy_since = [self._worker.busy_since]
        if self.overlap_prediction:
            busy_since.append(self.predictor.busy_since)
        started = [since for since in busy_since if since is not None]  # each read once: threads reset them
        return self._stalled_for(min(started, default=None))

    def _stalled_for(self, since: float | None) -> float | None:
        """How long work begun at `since` (time.monotonic) has run, once past `stall_s`; None
        before that, or with nothing under way."""
        busy = None if since is None else time.monotonic() - since
        return busy if busy is not None and busy >= self.stall_s else None

    def check_accepting(self) -> None:
        """Raise EngineDead or EngineShuttingDown unless new requests are taken."""
        if self.state is EngineState.FAILED:
            raise EngineDead(self.failure or "engine failed")
        if self.state is not EngineState.RUNNING:
            raise EngineShuttingDown()

    # ---- requests (event loop) ---------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int], prompt_text: str | None,
                     params: SamplingParams, *, tier: Tier = Tier.STANDARD, priority: int = 0,
                     arrival_time: float | None = None, group: ChoiceGroup | None = None) -> RequestStream:
        """Queue a request and wait until the engine admits it.

        `arrival_time` is on the engine's clock (`engine.now()`, monotonic); it defaults to now,
        so TTFT and queue time include the wait for the predictor.

        Raises EngineShuttingDown, EngineDead, or whatever LLMEngine.add_request raised
        (ValueError for bad input, AdmissionRejected when admission control refuses it).
        """
        self.check_accepting()
        if request_id in self._streams:
            # Checked here, not only by the engine: registering a second stream under a live id
            # would take over the first request's outputs, and its rejection would drop them.
            raise ValueError(f"request id {request_id!r} is already in use")
        submission = Submission(request_id, prompt_token_ids, prompt_text, params, tier, priority,
                                 self.engine.now() if arrival_time is None else arrival_time, group)
        stream = RequestStream(request_id, tier, submission)
        self._streams[request_id] = stream
        self._no_streams.clear()
        self._pending[request_id] = submission
        (self._to_predict if self.overlap_prediction else self._commands).put(submission)
        try:
            await asyncio.wrap_future(submission.admitted)
        except BaseException as exc:
            # Rejected, or the client left while waiting: forget the stream (its own: an abort may
            # have freed the id for a new request already); the engine thread skips a cancelled
            # submission, and the abort covers one it had already added (one already queued, for
            # an abandoned submission, would find a new request under the id instead).
            if self._streams.get(request_id) is stream:
                self._forget(request_id)
            if isinstance(exc, asyncio.CancelledError) and submission.abandoned is None:
                self._queue_abort(request_id)
                raise
            error = self._answer_for(submission, exc)
            self._tell(self.listener.on_rejected, tier, error)
            if error is not exc:
                raise error from None
            raise
        finally:
            if self._pending.get(request_id) is submission:  # not a later request reusing the id
                del self._pending[request_id]
        self._tell(self.listener.on_admitted, tier, len(prompt_token_ids))
        if submission.abandoned is not None:
            # Aborted (or drained) while the engine thread was adding it: admitted, so counted as
            # an aborted request, as the engine counts it; the Abort queued behind frees its
            # blocks, and the caller gets the answer it would have had a moment sooner, not a
            # stream that nothing will ever end.
            self._drop_aborted(request_id, stream)
            raise submission.abandoned
        return stream

    @staticmethod
    def _answer_for(submission: Submission, exc: BaseException) -> BaseException:
        """What a submit that ended before admission raises: the abandonment's error when the loop
        cancelled the submission itself (a drain or an abort), not the caller's task; else `exc`."""
        task = asyncio.current_task()
        cancelled_here = (isinstance(exc, asyncio.CancelledError) and submission.abandoned is not None
                          and submission.admitted.cancelled() and (task is None or task.cancelling() == 0))
        return submission.abandoned if cancelled_here else exc

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the next step boundary; its stream ends with
        finish_reason "abort" (one not yet admitted: its submit raises RequestAborted). Safe from
        any thread: from another, it runs on the loop, where the stream table is read and changed
        at once (read from the thread, it raced a submit of the same id)."""
        if self._loop is not None and not self._on_loop():
            self._post(self.abort, request_id)
            return
        stream, pending = self._streams.get(request_id), self._pending.get(request_id)
        self._abandon_and_abort(request_id, RequestAborted(request_id))
        if stream is None or (pending is not None and not pending.was_admitted()):
            return  # none to end, or its submit sees it abandoned, answers RequestAborted and counts it
        self._drop_aborted(request_id, stream)

    def _abandon_and_abort(self, request_id: str, error: Exception) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.abandoned = error  # first: the abort may reach the engine thread before it
            # Answered now unless a thread has taken it (both skip a cancelled one): it waited for
            # the predictor or the engine thread to come to it, which at a shutdown could outlast
            # the server's flush, and the client got a plain 500 instead of the 503.
            pending.admitted.cancel()
        self._queue_abort(request_id)

    def _queue_abort(self, request_id: str) -> None:
        """Queue an Abort (on the loop, or before the engine started), counted in flight first, so
        the count lands before the engine thread's word that the Abort was applied."""
        if self._loop is not None:
            self._count_abort(request_id)
        self._commands.put(Abort(request_id))

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            return False

    def _count_abort(self, request_id: str) -> None:
        self._aborts_in_flight[request_id] = self._aborts_in_flight.get(request_id, 0) + 1

    def _uncount_abort(self, request_id: str) -> None:
        left = self._aborts_in_flight.get(request_id, 0) - 1
        if left > 0:
            self._aborts_in_flight[request_id] = left
        else:
            self._aborts_in_flight.pop(request_id, None)

    def call_in_engine(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps; safe from any thread."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        if not self._worker.offer(Call(fn, result)):  # the engine thread has ended
            result.set_exception(self._closed_error())
        return result

    def _drop_aborted(self, request_id: str, stream: RequestStream | None = None) -> None:
        """End and forget an aborted request's stream: `stream` when given (another request may
        hold the id by now, and keeps its stream), else the one registered under the id."""
        registered = self._streams.get(request_id)
        stream = registered if stream is None else stream
        if stream is None or registered is not stream:
            return  # ended already (finished, failed, aborted once before), or the id is another's
        self._forget(request_id)
        if not stream.finished:
            stream.put(StreamEnd("abort", "the request was aborted"))  # a reader still waiting ends
            self._tell(self.listener.on_aborted, request_id, stream.tier)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._no_streams.set()

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            # The commands are applied in order, so while an abort of this id is in flight, its
            # outputs are the aborted request's, even if a new stream has taken the id.
            if stream is None or output.request_id in self._aborts_in_flight:
                continue
            self._tell(self.listener.on_output, output, stream.tier)
            stream.put(output)
            if output.finished:
                self._forget(output.request_id)
                self._tell(self.listener.on_finished, output, stream.tier, stream.prediction)

    def _fail_all(self, message: str) -> None:
        for request_id, stream in self._streams.items():
            stream.put(StreamEnd("error", message))
            pending = self._pending.get(request_id)
            if pending is None or pending.was_admitted():  # one never admitted is counted by its submit
                self._tell(self.listener.on_aborted, request_id, stream.tier, reason="error")
        self._streams.clear()
        self._no_streams.set()

    @staticmethod
    def _tell(callback: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """A listener call (metrics: bookkeeping) whose failure is logged, never raised: raised in
        the middle of a step's outputs, it left the streams after it without their outputs, a
        finished one without its end, and the client waiting for good."""
        try:
            callback(*args, **kwargs)
        except Exception:  # noqa: BLE001
            logger.exception("the engine listener failed")

    # ---- engine thread callbacks (called on it) ------------------------------------------------
    def _outputs_ready(self, outputs: Sequence[RequestOutput]) -> None:
        self._post(self._deliver, outputs)

    def _abort_applied(self, request_id: str) -> None:
        # Posted after every output of the steps before the abort: FIFO, as call_soon_threadsafe is.
        self._post(self._uncount_abort, request_id)

    def _engine_failed(self, message: str) -> None:
        self.failure = message
        with self._state_lock:
            self.state = EngineState.FAILED
        self._post(self._fail_all, message)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback` on the event loop. Nobody listens once the loop has closed: a thread
        left behind by a shutdown (a stuck step that returned late) then ends quietly."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if not self._loop.is_closed():
                raise
