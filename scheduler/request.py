"""The request as the scheduler sees it, and its sampling parameters.

One token-accounting model: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (those whose K/V sit in the cache). Each step grants it some
`num_new_tokens`; there is no separate prefill or decode phase.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import numbers
from dataclasses import dataclass, field, replace

from scheduler.expected_length import capped_lognormal_mean


logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute-preempted: back in the waiting queue, cache freed
    SWAPPED = "swapped"  # swap-preempted: blocks live in the host pool
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Tier(enum.IntEnum):
    """Priority tiers; a lower value is served first, before any length score."""

    INTERACTIVE = 0  # target TTFT < 500 ms
    STANDARD = 1  # target end-to-end < 10 s
    BATCH = 2  # throughput only


# Seeds are 64-bit integers, signed or not (the sampler hashes a seed's 64 bits with the position);
# -1 is no seed, as in vLLM.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Priorities are integers within a signed 64-bit range, as a client (or vLLM) may send them.
PRIORITY_LIMIT = 2**63
# vLLM's: a temperature above 0 and below this is raised to it and sampled (0 alone is greedy):
# dividing float32 logits by a denormal temperature gives inf, softmax NaN, and a meaningless draw.
MIN_SAMPLING_TEMPERATURE = 0.01
# Most alternatives a request may ask logprobs for, per token (vLLM's default max_logprobs, and
# OpenAI's bound on chat's top_logprobs).
MAX_LOGPROBS = 20
# OpenAI's range for presence and frequency penalties.
PENALTY_LIMIT = 2.0
# OpenAI's range for a logit bias; larger values are clamped to it, as vLLM does.
LOGIT_BIAS_LIMIT = 100.0


# Public: the engine's config checks its numbers by the same rules (a bool is no number).
def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@functools.lru_cache(maxsize=16)
def _warn_raised_temperature(temperature: float) -> None:
    """Said once per value (cached), as vLLM's warn-once says it: the server makes one
    SamplingParams per prompt, and a batch of 256 logged 256 identical lines."""
    logger.warning("temperature %g is below %g, where float32 logits overflow: sampled at %g",
                   temperature, MIN_SAMPLING_TEMPERATURE, MIN_SAMPLING_TEMPERATURE)


def plain_number(value: object) -> object:
    """An integer or real number of another type (NumPy's, as `tokenizer(..., return_tensors="np")`
    or a sweep over np.linspace gives them) as Python's int or float, so the checks take it and
    nothing downstream holds a foreign type; a bool, a Python number or anything else unchanged."""
    if isinstance(value, bool) or type(value) in (int, float) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def listed(value: object) -> object:
    """An array (NumPy's, torch's: anything with `tolist`) as the list it holds; anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, list, tuple)) else value


# SamplingParams' number fields, made plain (plain_number) before they are checked.
NUMBER_FIELDS = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "prompt_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def _as_tuple(values: object, name: str) -> tuple:
    """A list or tuple (or an array: anything with NumPy's and torch's `tolist`) as a tuple of
    plain numbers (plain_number), None as (); anything else is a ValueError naming the field."""
    if values is None:
        return ()
    values = listed(values)
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list or tuple, got {values!r}")
    return tuple(map(plain_number, values))


@dataclass(frozen=True)
class SamplingParams:
    # vLLM's: sequences per prompt. The front ends (LLM.generate and the server) make choice i a
    # request of its own (`choice(i)`), so a request the scheduler sees has n == 1.
    n: int = 1
    # None: the rest of the context (vLLM's), which the engine fills in for each prompt before the
    # request reaches the scheduler.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1, stored as 0) = disabled
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: the stop string (or stop token's text) that ended the output stays in its text.
    include_stop_str_in_output: bool = False
    # vLLM's: special tokens (<|im_start|>, ...) are left out of the text unless this is False.
    skip_special_tokens: bool = True
    # None: no logprobs. N >= 0: each generated token's log-probability under the model, with the
    # N likeliest alternatives at that position.
    logprobs: int | None = None
    # vLLM's: None, or each prompt token's log-probability (after the first) with N alternatives.
    prompt_logprobs: int | None = None
    # As OpenAI and vLLM define them: presence and frequency penalties subtract from the logit of
    # every token already generated (once, or once per occurrence); the repetition penalty (HF's,
    # over prompt and output) divides a positive logit and multiplies a negative one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: no end of sequence, stop token or stop string ends the output before this many tokens.
    min_tokens: int = 0
    # OpenAI's: (token id, bias) pairs added to the logits before sampling (a dict is taken too).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: when set, only these token ids can be generated.
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad words, as token id sequences: the last token of each is ruled out wherever the
    # output ends with the ones before it (a one-token word: everywhere).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: prefix caching shares KV blocks only between requests with the same salt
    # (or none), so one tenant cannot time its way to another's prompts. Not a sampling setting,
    # but it travels with the request to the scheduler as these do.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Types are checked too: a float seed or a string temperature would otherwise pass here
        # and fail with a TypeError inside an engine step, part-way through a generate call.
        for name in NUMBER_FIELDS:
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not is_real(self.temperature) or not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            _warn_raised_temperature(self.temperature)
            object.__setattr__(self, "temperature", MIN_SAMPLING_TEMPERATURE)
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0, or -1 (disabled), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed", as clients and UIs send it
            object.__setattr__(self, "seed", None)
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt
                                                and has_utf8_form(self.cache_salt)):
            raise ValueError(f"cache_salt must be a non-empty string (valid UTF-8) or None, got {self.cache_salt!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        self._check_penalties()
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens {self.max_tokens}], got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _as_tuple(self.allowed_token_ids, "allowed_token_ids")
            if not allowed or any(not is_int(i) or i < 0 for i in allowed):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(_as_tuple(word, "bad_words_token_ids") for word in _as_tuple(self.bad_words_token_ids,
                                                                                   "bad_words_token_ids"))
        if any(not word or any(not is_int(t) or t < 0 for t in word) for word in words):
            raise ValueError(f"bad_words_token_ids must be non-empty sequences of token ids, got {words!r}")
        object.__setattr__(self, "bad_words_token_ids", words)
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        stop_token_ids = _as_tuple(self.stop_token_ids, "stop_token_ids")
        if any(not is_int(i) or i < 0 for i in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {stop_token_ids!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value!r}")
        value = self.repetition_penalty
        if not is_real(value) or not _finite(value) or value <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {value!r}")

    def choice(self, index: int) -> SamplingParams:
        """Choice `index` of n as a request of its own: one sequence, seed + index (wrapped within a
        seed's 64 bits) so that seeded choices differ and repeat. The prompt the choices share is
        scored by the first alone."""
        if index == 0:
            return self if self.n == 1 else replace(self, n=1)
        seed = None if self.seed is None else (self.seed + index) & SEED_MAX
        return replace(self, n=1, seed=seed, prompt_logprobs=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clamp_length(self, length: float) -> float:
        """A predicted output length within what these parameters allow: [max(1, min_tokens), max_tokens]."""
        return max(1.0, float(self.min_tokens), min(length, float(self.max_tokens)))


def has_utf8_form(text: str) -> bool:
    """Whether `text` can be encoded (a lone UTF-16 surrogate cannot), as hashing or sending it needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted (token id, bias) pairs, each bias clamped to +-LOGIT_BIAS_LIMIT."""
    pairs = tuple(bias.items()) if isinstance(bias, dict) else _as_tuple(bias, "logit_bias")
    clean = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        token, value = map(plain_number, pair)
        if not is_int(token) or token < 0 or not is_real(value) or not _finite(value):
            raise ValueError(f"logit_bias must map token ids (integers >= 0) to finite numbers, got {pair!r}")
        clean[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return tuple(sorted(clean.items()))


def member_ids(request_id: str, count: int) -> list[str]:
    """The engine request ids of an API request's `count` members (its choices, or a batch's
    prompts): its own id for one, id-i for member i of more."""
    return [request_id] if count == 1 else [f"{request_id}-{index}" for index in range(count)]


@dataclass(frozen=True)
class ChoiceGroup:
    """The sequences of one API request (its `n` choices of each of its prompts), each a request
    of its own: admission decides on them as one unit, so none counts as work ahead of another."""

    group_id: str
    size: int
    # The prompt tokens every member feeds, together (a batch's prompts differ); None: each member's
    # own prompt `size` times, as the choices of one prompt feed it.
    prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.size) or self.size < 1:
            raise ValueError(f"a choice group has at least one member, got {self.size!r}")
        if self.prompt_tokens is not None and (not is_int(self.prompt_tokens) or self.prompt_tokens < 1):
            raise ValueError(f"a choice group feeds at least one prompt token, got {self.prompt_tokens!r}")


@dataclass
class Request:
    """Owned and mutated by the scheduler only; the engine reads it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    tier: Tier = Tier.STANDARD
    priority: int = 0  # vLLM semantics: lower is served first
    predicted_len: float | None = None  # point estimate of output tokens, set once at admission
    predicted_p90: float | None = None
    true_len: int | None = None  # known only to the oracle policy (benchmarks)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Queueing again after a preemption: since when (None while it holds a seat), and each such
    # wait as (requeued, scheduled again).
    requeued_at: float | None = None
    requeued_waits: list[tuple[float, float]] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    predicted_p50: float | None = None  # median of the predicted output length (srpt's tail fit)
    # The predictor's ranking length in output tokens: what sjf and srpt order by (see
    # predictor.base.Prediction.rank_len).
    predicted_rank_len: float | None = None
    group: ChoiceGroup | None = None
    # Prefix caching (prefix_cache.py): the chain hash of each full block of its tokens, computed
    # once; and how many prompt tokens its first admission found cached (None before it).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # The model's other end tokens (its generation config's): they stop it as stop tokens do
    # (the engine adds them to stop_token_ids, but not under ignore_eos), and min_tokens rules
    # them out, with the end token, even under ignore_eos, as vLLM's does.
    extra_eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if self.sampling_params.max_tokens is None:
            raise ValueError("max_tokens None (the rest of the context) must be resolved before scheduling")
        if not (is_int(self.priority) and -PRIORITY_LIMIT <= self.priority < PRIORITY_LIMIT):
            raise ValueError(f"priority must be an integer in [-2**63, 2**63), got {self.priority!r}")
        # The policies sort by it: a string failed inside the sort, a NaN sorted anywhere.
        if not (is_real(self.arrival_time) and _finite(self.arrival_time)):
            raise ValueError(f"arrival_time must be a finite number, got {self.arrival_time!r}")

    def shares_group_with(self, other: Request) -> bool:
        """Whether both are sequences of one API request (a request shares its group with itself)."""
        return self.group is not None and other.group == self.group

    @property
    def group_size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def group_prompt_tokens(self) -> int:
        """The prompt tokens its API request's members feed together (its own alone, ungrouped)."""
        if self.group is None or self.group.prompt_tokens is None:
            return self.group_size * self.num_prompt_tokens
        return self.group.prompt_tokens

    @property
    def requeued_wait_s(self) -> float:
        return total_requeued_wait_s(self.requeued_waits)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_to_feed(self) -> int:
        """Known tokens whose KV is not computed yet: the prompt's rest while it prefills, then the
        last sampled token each decode (and every token again after a recompute preemption)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def feeds_a_prefill_chunk(self) -> bool:
        """More than one token to feed: a prompt (or, after a recompute, its generated tokens)
        still prefilling. A decode feeds one: the token sampled last."""
        return self.num_tokens_to_feed > 1

    @property
    def predicted_total(self) -> float:
        """The first point estimate of output length within [max(1, min_tokens), max_tokens];
        max_tokens when nothing was predicted."""
        params = self.sampling_params
        return params.clamp_length(params.max_tokens if self.predicted_len is None else self.predicted_len)

    @property
    def predicted_mean(self) -> float:
        """The mean of the predicted output length, what sums of token work add up: a lognormal
        through the predicted p50 and p90, capped at max_tokens (expected_length.py), then within
        [max(1, min_tokens), max_tokens]. The point estimate when no spread was predicted (no p90
        above p50)."""
        p50, p90 = self.predicted_p50, self.predicted_p90
        if self.predicted_len is None or p50 is None or p90 is None or not 0.0 < p50 < p90:
            return self.predicted_total
        params = self.sampling_params
        return params.clamp_length(capped_lognormal_mean(p50, p90, float(params.max_tokens)))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def total_requeued_wait_s(requeued_waits) -> float:
    """Seconds spent queued again after preemptions: each (requeued, scheduled again) pair's span."""
    return sum(end - start for start, end in requeued_waits)
