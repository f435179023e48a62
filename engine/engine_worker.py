"""The engine thread of `AsyncLLMEngine`: the one thread that touches the LLMEngine once started.

Between steps it applies the queued commands in order (add, abort, call, stop): an arrival group
is scored by the predictor first when prediction runs inline, at most the predictor's batch of
them between two steps. A step's outputs go to the event loop through `on_outputs`; an exception
anywhere ends the thread through `on_failure`, and every command still queued, or queued later,
is refused, so no caller waits forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from engine.arrival_predictor import ArrivalPredictor
from engine.async_stream import EngineDead, EngineShuttingDown
from engine.engine_commands import Abort, Call, Stop, Submission, refuse_until_stopped

logger = logging.getLogger(__name__)

# How often an idle engine thread renews its stats snapshot. The stability margin is over a sliding
# window of time: without this, /metrics kept the last margin under load on a server gone idle.
IDLE_STATS_REFRESH_S = 1.0


class EngineWorker:
    def __init__(self, engine: Any, commands: queue.SimpleQueue, inline_predictor: ArrivalPredictor | None,
                 on_outputs: Callable[[Sequence[Any]], None], on_failure: Callable[[str], None],
                 on_abort_applied: Callable[[str], None] = lambda request_id: None) -> None:
        self.engine = engine
        self.commands = commands
        self.inline_predictor = inline_predictor  # None: no predictor, or a predictor thread scores
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._on_abort_applied = on_abort_applied  # after each Abort, whether or not it found its request
        self.stats: Any = engine.stats()  # replaced (never mutated) after each step
        self._live: set[str] = set()  # request ids inside the LLMEngine
        self._stop_taken = False  # a failure after it must not wait for another Stop
        # When the step, or the round of commands (inline prediction included), under way began,
        # on time.monotonic; None between them. Read by other threads: a step that never returns
        # raises nothing, and only this tells /health that nothing progresses.
        self.busy_since: float | None = None
        # Set once the thread answers no more commands; offered commands are put under the lock, so
        # one is either seen by the last refusal or refused at once, never left unanswered.
        self._closing = threading.Lock()
        self.closed = False

    def run(self) -> None:
        try:
            while self.run_commands(block=not self.engine.has_unfinished_requests()):
                if not self.engine.has_unfinished_requests():
                    continue
                self.busy_since = time.monotonic()
                try:
                    outputs = self.engine.step()
                finally:
                    self.busy_since = None
                for output in outputs:
                    if output.finished:
                        self._live.discard(output.request_id)
                self.stats = self.engine.stats()
                if outputs:
                    self._on_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - every failure must end the streams
            logger.exception("engine loop failed")
            message = f"{type(exc).__name__}: {exc}"
            self._on_failure(message)
            self._close(EngineDead(message), block=not self._stop_taken)
            return
        self._close(EngineShuttingDown(), block=False)

    def offer(self, command: Any) -> bool:
        """Queue `command` unless the thread has ended (False then: nobody would answer it)."""
        with self._closing:
            if self.closed:
                return False
            self.commands.put(command)
            return True

    def _close(self, error: Exception, block: bool) -> None:
        """Refuse what is queued (until a Stop, when `block`), then close: what was offered
        before the close is refused here, what comes after is refused by `offer`."""
        refuse_until_stopped(self.commands, error, block=block)
        with self._closing:
            self.closed = True
        refuse_until_stopped(self.commands, error, block=False)

    def run_commands(self, block: bool) -> bool:
        """Apply every queued command; wait for one first when `block`. False once told to stop."""
        commands = []
        if block:
            try:
                commands.append(self.commands.get(timeout=IDLE_STATS_REFRESH_S))
            except queue.Empty:  # idle: stats that move with time alone still move
                self.stats = self.engine.stats()
                return True
        # Inline, at most one predictor batch of arrivals between two steps: a burst scored whole
        # froze every running stream (and the aborts behind it) for the whole batch's prediction.
        # The rest stay queued, in order, for the next round.
        limit = self.inline_predictor.max_batch if self.inline_predictor is not None else None
        arrivals = sum(isinstance(c, Submission) for c in commands)
        while not self.commands.empty() and (limit is None or arrivals < limit):
            command = self.commands.get_nowait()
            commands.append(command)
            arrivals += isinstance(command, Submission)
        applied, stopped = 0, False
        # Applying them counts as busy too: an add, an abort or a call that never returns stalls
        # the engine as a stuck step does.
        self.busy_since = started = time.monotonic()
        try:
            if self.inline_predictor is not None:
                # Not one the client left, or that an abort marked while it queued: refused below.
                arrivals = [c for c in commands if isinstance(c, Submission) and not c.admitted.cancelled()
                            and c.abandoned is None]
                if arrivals:
                    self.inline_predictor.predict_batch(arrivals)
            for command in commands:
                if isinstance(command, Stop):
                    stopped = self._stop_taken = True
                    break
                applied += 1  # counted first: a command that raised is not tried again
                self._apply(command)
        finally:
            self.busy_since = None
            if commands and not block:  # requests were running: no token moved while these applied
                self.engine.charge_time_between_steps(time.monotonic() - started)
            # What was not applied goes back on the queue, to be refused once the loop ends (after a
            # Stop, or when applying a command raised and the loop fails), so no caller waits
            # forever. A Stop that was obeyed is not put back; one not reached is.
            for later in commands[applied + 1:] if stopped else commands[applied:]:
                self.commands.put(later)
        if stopped:
            for request_id in list(self._live):
                self.engine.abort_request(request_id)
            self._live.clear()
            self.stats = self.engine.stats()
            return False
        if commands:
            self.stats = self.engine.stats()
        return True

    def _apply(self, command: Submission | Abort | Call) -> None:
        if isinstance(command, Submission):
            self._add(command)
        elif isinstance(command, Abort):
            if command.request_id in self._live:
                self._live.discard(command.request_id)
                self.engine.abort_request(command.request_id)
            self._on_abort_applied(command.request_id)
        elif command.result.set_running_or_notify_cancel():
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                command.result.set_exception(exc)
            except BaseException as exc:
                _answer_and_fail(command.result, exc)

    def _add(self, submission: Submission) -> None:
        if not submission.admitted.set_running_or_notify_cancel():
            return  # the client left before the engine got to it
        if submission.abandoned is not None:
            submission.admitted.set_exception(submission.abandoned)
            return
        try:
            self.engine.add_request(
                submission.request_id, submission.prompt_token_ids, submission.params,
                tier=submission.tier, priority=submission.priority,
                arrival_time=submission.arrival_time, prediction=submission.prediction, group=submission.group)
        except Exception as exc:  # noqa: BLE001 - ValueError, AdmissionRejected: the caller's answer
            submission.admitted.set_exception(exc)
            return
        except BaseException as exc:
            _answer_and_fail(submission.admitted, exc)
        self._live.add(submission.request_id)
        submission.admitted.set_result(None)


def _answer_and_fail(future: Any, exc: BaseException) -> None:
    """A SystemExit (or another BaseException that is no Exception) raised while applying a command:
    its future is already running, so the refusal of queued commands would skip it and its caller
    would wait forever. It gets EngineDead (the exception itself would escape the caller's event
    loop), and the exception ends the engine loop as any failure does."""
    future.set_exception(EngineDead(f"{type(exc).__name__}: {exc}"))
    raise exc
