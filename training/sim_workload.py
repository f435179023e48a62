"""The simulator's workload: ShareGPT test-split turns with true and predicted lengths, arrivals.

Turns come from `training.dataset.load_turns("test")`, kept when the prompt has at most
`max_prompt_tokens` tokens and the reply at least one; the true output length is the ShareGPT reply
length in SmolLM2 tokens, capped at `max_output_tokens` (the requests' max_tokens). Predictions come
from a saved predictor (`predictor.load`), cached per predictor under data/cache/ by a hash of
the prompt text so a rerun does not recompute them, or, for development only, from a noisy oracle
(true length times lognormal noise). Arrivals are Poisson or gamma (bursty: coefficient of
variation above 1).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from engine.config import REPO_ROOT
from scheduler.expected_length import Z90
from scheduler.request import Tier
from scheduler.simulation import SimRequest

CACHE_DIR = REPO_ROOT / "data" / "cache" / "sim_predictions"
NOISY_ORACLE = "noisy-oracle"
NOISY_ORACLE_SIGMA = 0.6  # log-space noise of the development predictions

ArrivalProcess = Literal["poisson", "gamma"]


@dataclass(frozen=True)
class Turn:
    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Predicted:
    point: float
    p50: float
    p90: float
    rank_len: float


def load_test_turns(num_requests: int, seed: int, max_prompt_tokens: int, max_output_tokens: int,
                    exclude_train_prompts: bool = False) -> list[Turn]:
    """Test-split turns; with `exclude_train_prompts`, not those whose prompt also occurs in the
    train split (real traffic, but the predictor may have memorized their lengths: about 8% of
    the pool; the default ranks the test split's repeats at tau 0.71 against 0.45)."""
    from training.dataset import load_turns

    table = load_turns("test")
    rows = [
        Turn(prompt, p, min(r, max_output_tokens))
        for prompt, p, r, in_train in zip(table["prompt"], table["prompt_tokens"], table["response_tokens"],
                                          table["in_train"])
        if p <= max_prompt_tokens and r >= 1 and not (exclude_train_prompts and in_train)
    ]
    if not rows:
        raise ValueError(f"--max-prompt-tokens {max_prompt_tokens}: no test turn fits")
    rng = random.Random(seed)
    if num_requests <= len(rows):
        return rng.sample(rows, num_requests)
    return [rng.choice(rows) for _ in range(num_requests)]


def noisy_oracle(turns: Sequence[Turn], seed: int) -> list[Predicted]:
    rng = random.Random(seed + 1)
    out = []
    for turn in turns:
        point = max(1.0, turn.output_tokens * math.exp(rng.gauss(0.0, NOISY_ORACLE_SIGMA)))
        out.append(Predicted(point, point, point * math.exp(Z90 * NOISY_ORACLE_SIGMA), point))
    return out


# Part of the cache file's name; changed whenever cached predictions would differ, so old files
# are not read. Version 1 keyed by conversation id and turn index, which name several prompts (the
# turn index restarts in each `_N` chunk of a conversation): about a quarter of the requests got
# another prompt's prediction. Then served embeddings were rounded to fp16 like training's; then
# the key became the trace's prompt key; then each entry gained the ranking length.
CACHE_FORMAT = "prompt-hash-v4, fp16-rounded embeddings, rank_len"


def _cache_path(predictor_path: Path, cache_dir: Path) -> Path:
    """Named by the predictor's folder and every byte in it, so a predictor retrained or edited in
    place (heads.json picks the heads) gets a new cache."""
    hasher = hashlib.sha256((CACHE_FORMAT + str(predictor_path.resolve())).encode())
    for path in sorted(p for p in predictor_path.rglob("*") if p.is_file()):
        hasher.update(str(path.relative_to(predictor_path)).encode())
        hasher.update(path.read_bytes())
    return cache_dir / f"{predictor_path.name}_{hasher.hexdigest()[:16]}.json"


def predictor_predictions(turns: Sequence[Turn], predictor_path: Path,
                          cache_dir: Path = CACHE_DIR) -> list[Predicted]:
    """The saved predictor's predictions, computed once per distinct prompt and cached."""
    cache_file = _cache_path(predictor_path, cache_dir)
    cache: dict[str, list[float]] = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    from training.trace import prompt_key  # the key the trace gives a prompt

    keys = [prompt_key(t.prompt) for t in turns]
    missing = sorted({key: t.prompt for key, t in zip(keys, turns) if key not in cache}.items())
    if missing:
        import predictor
        from predictor.batching import predict_in_batches

        model = predictor.load(predictor_path)
        predictions = predict_in_batches(model, [prompt for _, prompt in missing], progress=True)
        for (key, _), p in zip(missing, predictions):
            cache[key] = [float(p.point), float(p.p50), float(p.p90), float(p.rank_len)]
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache))
    return [Predicted(*cache[key]) for key in keys]


def arrival_times(count: int, rate_per_s: float, process: ArrivalProcess, cv: float, seed: int) -> list[float]:
    """Cumulative inter-arrival gaps with mean 1/rate: exponential, or gamma with the given CV."""
    rng = random.Random(seed + 2)
    shape = 1.0 / (cv * cv)
    now, times = 0.0, []
    for _ in range(count):
        if process == "poisson":
            now += rng.expovariate(rate_per_s)
        else:
            now += rng.gammavariate(shape, 1.0 / (shape * rate_per_s))
        times.append(now)
    return times


def assign_tiers(count: int, mix: Sequence[float], seed: int) -> list[Tier]:
    """Tiers drawn with weights (interactive, standard, batch)."""
    rng = random.Random(seed + 3)
    return rng.choices([Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH], weights=mix, k=count)


def build_workload(turns: Sequence[Turn], predictions: Sequence[Predicted], arrivals: Sequence[float],
                   tiers: Sequence[Tier], *, max_tokens: int | None) -> list[SimRequest]:
    """`max_tokens`: what each request sends as its cap (the workload's `max_output_tokens`), or None
    to send its true length, as `bench serve --ignore-eos` does."""
    return [
        SimRequest(request_id=f"req{i}", arrival_time=arrival, prompt_tokens=turn.prompt_tokens,
                   output_tokens=turn.output_tokens, predicted_len=max(1.0, pred.point),
                   predicted_p50=max(1.0, pred.p50), predicted_p90=max(1.0, pred.p90),
                   predicted_rank_len=max(1.0, pred.rank_len), tier=tier, max_tokens=max_tokens)
        for i, (turn, pred, arrival, tier) in enumerate(zip(turns, predictions, arrivals, tiers))
    ]
