"""Length prediction for arrivals: once per request, at admission, in batches, off the event loop.

`ArrivalPredictor.predict_batch` scores a group of submissions in one predictor call. The
AsyncLLMEngine's engine thread calls it for the arrivals it drains between steps (the CPU default:
predictor and model never compete for the cores), or `run` scores them on a thread of their own
while the engine steps (a GPU engine leaves the CPU idle) and forwards them to the engine thread.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from engine.engine_commands import Submission
from predictor.base import Predictor

logger = logging.getLogger(__name__)


class ArrivalPredictor:
    def __init__(self, predictor: Predictor, on_prediction: Callable[[float, int], None],
                 max_batch: int = 64) -> None:
        if max_batch < 1:  # none per batch would leave every arrival, and the commands behind it, queued
            raise ValueError(f"max_predict_batch must be at least 1, got {max_batch}")
        self.predictor = predictor
        self.on_prediction = on_prediction  # (seconds, batch size) of each successful call
        self.max_batch = max_batch
        # When the batch `run` scores began (time.monotonic), None between batches: a predictor
        # thread stuck in a call holds every arrival back, which /health must see.
        self.busy_since: float | None = None

    def predict_batch(self, batch: list[Submission]) -> None:
        """Set each submission's prediction; on a predictor failure leave them unset.

        Each distinct prompt is scored once: the n choices of one request share theirs, and so do
        repeats of a popular prompt that arrive together. A submission without a prompt text has
        nothing to predict (a prompt scored alone, its one hidden token known)."""
        prompts = list(dict.fromkeys(s.prompt_text for s in batch if s.prompt_text is not None))
        if not prompts:
            return
        started = time.perf_counter()
        try:
            predictions = dict(zip(prompts, self.predictor.predict(prompts)))
            self.on_prediction(time.perf_counter() - started, len(prompts))
        except BaseException:  # noqa: BLE001 - on a worker thread, a SystemExit too must not strand the batch
            # Serving goes on without a prediction; the policy treats the length as unknown.
            logger.exception("predictor failed on a batch of %d prompts", len(prompts))
            return
        for submission in batch:  # a predictor that answered fewer prompts leaves the rest unset
            if submission.prompt_text is not None:
                submission.prediction = predictions.get(submission.prompt_text)

    def run(self, arrivals: queue.SimpleQueue, offer: Callable[[Submission], bool],
            refuse: Callable[[Submission], None]) -> None:
        """Score what arrives, up to `max_batch` at a time, and `offer` it to the engine thread,
        until a None arrives; a submission the engine thread no longer takes (it has ended, after
        a shutdown gave up on this thread) is `refuse`d, so its caller is answered.

        Everything taken before the None is still scored and passed on, so a Stop queued after
        this returns finds no submission behind it."""
        while True:
            batch = [arrivals.get()]
            while len(batch) < self.max_batch and not arrivals.empty():
                batch.append(arrivals.get_nowait())
            stopping = None in batch
            batch = [s for s in batch if s is not None and not s.admitted.cancelled()]
            if batch:
                self.busy_since = time.monotonic()
                try:
                    self.predict_batch(batch)
                finally:
                    self.busy_since = None
            for submission in batch:
                if not offer(submission):
                    refuse(submission)
            if stopping:
                return
