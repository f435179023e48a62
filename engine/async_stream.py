"""What the async engine hands its callers: states, errors, the listener seam and request streams.

A `RequestStream` carries one request's outputs from the engine thread (through
`call_soon_threadsafe`, so only the event loop touches it) to one HTTP handler; it ends after the
finished output, or with a `StreamEnd` when the request was cut short (shutdown, engine failure,
an abort).
Each RequestOutput is cumulative (all tokens and text so far), so the stream keeps only the newest
unread one: a reader that falls behind gets the latest state in one piece, and a stalled client
costs one output of memory instead of a queue that grows with every step.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from predictor.base import Prediction
from scheduler.request import Tier

if TYPE_CHECKING:
    from engine.engine_commands import Submission
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # finishing in-flight requests; new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"  # the step loop raised; every stream was ended with an error


class EngineShuttingDown(RuntimeError):
    """A request arrived after shutdown began."""


class EngineDead(RuntimeError):
    """The engine thread failed; the message says why."""


class RequestAborted(RuntimeError):
    """`abort` was called for the request before the engine admitted it."""


class EngineListener(Protocol):
    """What the async engine reports as requests move; the server's metrics implement it."""

    def on_admitted(self, tier: Tier, num_prompt_tokens: int) -> None: ...
    def on_rejected(self, tier: Tier, error: Exception) -> None: ...
    def on_output(self, output: RequestOutput, tier: Tier) -> None: ...  # every delivered output
    def on_aborted(self, request_id: str, tier: Tier, reason: str = "abort") -> None: ...  # or "error"
    def on_prediction(self, latency_s: float, batch_size: int) -> None: ...
    def on_finished(self, output: RequestOutput, tier: Tier, prediction: Prediction | None) -> None: ...


class NullListener(EngineListener):
    """Ignores every report (the protocol's methods all return None)."""


@dataclass(frozen=True)
class StreamEnd:
    """Last item of a stream that ended without a finished output (abort at shutdown, failure)."""

    reason: str  # "abort" | "error"
    message: str = ""
    # The request's text so far when the end replaced an output nobody had read yet, so the
    # reader can still send what was generated since its last read; "" otherwise.
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] | None = None  # likewise, the unread output's logprobs
    token_ids: tuple[int, ...] | None = None  # likewise, the unread output's generated tokens (None: none unread)


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one."""

    def __init__(self, request_id: str, tier: Tier, submission: Submission | None = None) -> None:
        self.request_id = request_id
        self.tier = tier
        # What the request was submitted as: the predictor writes its prediction there before the
        # engine takes it, so it is read there (copied when `submit` resumed, it was still None
        # for a request that finished before that: a short request left out of the tau metric).
        self.submission = submission
        self.finished = False  # the last item has been read
        self._unread: RequestOutput | StreamEnd | None = None
        self._ready = asyncio.Event()

    @property
    def prediction(self) -> Prediction | None:
        return None if self.submission is None else self.submission.prediction

    @staticmethod
    def _is_last(item: RequestOutput | StreamEnd | None) -> bool:
        return isinstance(item, StreamEnd) or (item is not None and item.finished)

    def put(self, item: RequestOutput | StreamEnd) -> None:
        if self._is_last(self._unread):
            return  # the end is already waiting to be read; nothing may replace it
        if isinstance(item, StreamEnd) and self._unread is not None:
            item = replace(item, text=self._unread.text, logprobs=self._unread.logprobs,  # keep what was unread
                           token_ids=self._unread.token_ids)
        self._unread = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput | StreamEnd:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._unread = self._unread, None
        self.finished = self._is_last(item)
        return item
