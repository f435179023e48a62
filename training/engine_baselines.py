"""The three systems `lengthwise bench engine` compares, on one workload and one concurrency.

- engine: our LLMEngine (continuous batching, paged KV cache, chunked prefill).
- hf_static: HF `generate` in static batches of `max_num_seqs` prompts, left-padded; eos is
  suppressed (`min_new_tokens`) so each batch runs until its longest member's `max_tokens`, and
  only each request's own `max_tokens` count as useful output: the padding and the rows kept
  running after they are done are the waste of static batching.
- hf_continuous: transformers' own continuous batching manager (sdpa attention, CPU), one request
  per prompt with its own `max_new_tokens` and eos disabled.
Every run reports useful output tokens and wall seconds; throughput is their ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepRecord
from scheduler.request import SamplingParams


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class RunResult:
    name: str
    useful_tokens: int
    seconds: float
    overhead_share: float | None = None  # engine only: step time outside the model forward
    steps: list[StepRecord] = field(default_factory=list)  # engine only

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0


def run_engine(items: list[WorkItem], config: EngineConfig) -> RunResult:
    engine = LLMEngine(config)
    _engine_warmup(engine)
    stats_before = engine.stats()
    for i, item in enumerate(items):
        engine.add_request(f"bench-{i}", list(item.prompt_ids),
                           SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
    steps: list[StepRecord] = []
    useful = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            useful += len(output.new_token_ids)
        steps.append(engine.last_step)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    step_time = stats.step_time_s - stats_before.step_time_s
    forward_time = stats.forward_time_s - stats_before.forward_time_s
    return RunResult("engine", useful, seconds, 1.0 - forward_time / step_time, steps)


def _engine_warmup(engine: LLMEngine) -> None:
    """One short request so first-call costs (allocator, kernels) stay out of the timing."""
    engine.add_request("warmup", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _load_hf_model(model_dir: str):
    """The HF model, warmed by one short generate, as the engine is: first-call costs (allocator,
    kernels) stay out of every timing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        model.generate(torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
    return model


def run_hf_static(items: list[WorkItem], model_dir: str, batch_size: int, pad_token_id: int) -> RunResult:
    model = _load_hf_model(model_dir)
    useful = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(items), batch_size):
            batch = items[first:first + batch_size]
            width = max(len(item.prompt_ids) for item in batch)
            input_ids = torch.tensor([[pad_token_id] * (width - len(i.prompt_ids)) + list(i.prompt_ids) for i in batch])
            attention_mask = torch.tensor([[0] * (width - len(i.prompt_ids)) + [1] * len(i.prompt_ids) for i in batch])
            longest = max(item.max_tokens for item in batch)
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=pad_token_id)
            assert out.shape[1] - width == longest
            useful += sum(item.max_tokens for item in batch)
    return RunResult("hf_static", useful, time.perf_counter() - start)


def run_hf_continuous(items: list[WorkItem], model_dir: str, max_num_seqs: int, max_num_batched_tokens: int,
                      kv_cache_tokens: int) -> RunResult:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _load_hf_model(model_dir)
    page_size = 256
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
    batching_config = ContinuousBatchingConfig(
        max_requests_per_batch=max_num_seqs, max_batch_tokens=max_num_batched_tokens, page_size=page_size,
        num_blocks=max(1, kv_cache_tokens // page_size), auto_switch_to_flash=False)
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=batching_config)
    useful, finished = 0, 0
    with torch.inference_mode():
        start = time.perf_counter()
        manager.start()
        try:
            for item in items:
                manager.add_request(list(item.prompt_ids), max_new_tokens=item.max_tokens, eos_token_id=-1)
            while finished < len(items):
                result = manager.get_result(timeout=1)
                if result is not None and result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
                if result is not None and result.is_finished():
                    finished += 1
                    useful += len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=10)
    return RunResult("hf_continuous", useful, seconds)
