"""The commands the event loop (and the predictor thread) send the engine thread of
`AsyncLLMEngine`, applied in queue order between engine steps."""

from __future__ import annotations

import concurrent.futures
import queue
from dataclasses import dataclass, field
from typing import Any, Callable

from predictor.base import Prediction
from scheduler.request import ChoiceGroup, SamplingParams, Tier


@dataclass
class Submission:
    """One request on its way from the loop, through the predictor, to the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    # The templated text the predictor scores; None: nothing to predict (a prompt scored alone,
    # whose one hidden token is known: no prediction, so its length is max_tokens, and no tau pair).
    prompt_text: str | None
    params: SamplingParams
    tier: Tier
    priority: int
    arrival_time: float
    group: ChoiceGroup | None = None
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    prediction: Prediction | None = None
    # Set when the request is aborted before the engine thread has it (it may still be with the
    # predictor, behind the abort): the error the engine thread then answers it with.
    abandoned: Exception | None = None

    def was_admitted(self) -> bool:
        """Whether the engine took it, though the loop may not have seen the answer yet."""
        taken = self.admitted
        return taken.done() and not taken.cancelled() and taken.exception() is None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    fn: Callable[[Any], Any]
    result: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    pass


def refuse(command: Any, error: Exception) -> None:
    """Answer a command that will never be applied with `error` (unless its caller has left)."""
    future = command.admitted if isinstance(command, Submission) else getattr(command, "result", None)
    if future is not None and future.set_running_or_notify_cancel():
        future.set_exception(error)


def refuse_until_stopped(commands: queue.SimpleQueue, error: Exception, block: bool = True) -> None:
    """Answer every command taken from `commands` with `error` until a Stop (or, without `block`,
    until the queue is empty), so that no caller waits forever on a loop that has ended."""
    while block or not commands.empty():
        command = commands.get()
        if isinstance(command, Stop):
            return
        refuse(command, error)
