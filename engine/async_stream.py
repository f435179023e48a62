"""What the async engine hands its callers: states, errors, the listener seam and request streams.

A `RequestStream` is an asyncio.Queue of one request's outputs, fed on the event loop by the
engine thread (through `call_soon_threadsafe`) and read by one HTTP handler; it ends after the
finished output, or with a `StreamEnd` when the request was cut short (shutdown, engine failure).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from predictor.base import Prediction
from scheduler.request import Tier

if TYPE_CHECKING:
    from engine.outputs import RequestOutput


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # finishing in-flight requests; new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"  # the step loop raised; every stream was ended with an error


class EngineShuttingDown(RuntimeError):
    """A request arrived after shutdown began."""


class EngineDead(RuntimeError):
    """The engine thread failed; the message says why."""


class EngineListener(Protocol):
    """What the async engine reports as requests move; the server's metrics implement it."""

    def on_admitted(self, tier: Tier, num_prompt_tokens: int) -> None: ...
    def on_rejected(self, tier: Tier, error: Exception) -> None: ...
    def on_tokens(self, num_new_tokens: int) -> None: ...
    def on_aborted(self, tier: Tier) -> None: ...
    def on_prediction(self, latency_s: float, batch_size: int) -> None: ...
    def on_finished(self, output: RequestOutput, tier: Tier, prediction: Prediction | None) -> None: ...


class NullListener:
    def on_admitted(self, tier: Tier, num_prompt_tokens: int) -> None: ...
    def on_rejected(self, tier: Tier, error: Exception) -> None: ...
    def on_tokens(self, num_new_tokens: int) -> None: ...
    def on_aborted(self, tier: Tier) -> None: ...
    def on_prediction(self, latency_s: float, batch_size: int) -> None: ...
    def on_finished(self, output: RequestOutput, tier: Tier, prediction: Prediction | None) -> None: ...


@dataclass(frozen=True)
class StreamEnd:
    """Last item of a stream that ended without a finished output (abort at shutdown, failure)."""

    reason: str  # "abort" | "error"
    message: str = ""


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one."""

    def __init__(self, request_id: str, tier: Tier) -> None:
        self.request_id = request_id
        self.tier = tier
        self.prediction: Prediction | None = None
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | StreamEnd] = asyncio.Queue()

    def put(self, item: RequestOutput | StreamEnd) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput | StreamEnd:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        self.finished = isinstance(item, StreamEnd) or item.finished
        return item
