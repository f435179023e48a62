"""The engine's step loop: schedule -> execute -> update, plus detokenization and stop strings.

`LLMEngine` owns the tokenizer, the model runner (model, KV cache, attention backend, sampler) and
the scheduler. One `step()`:
1. `scheduler.schedule(now)` picks the chunks of this step (any urgent admission first, then the
   running requests by tier, decodes before prefill chunks, then new prefill chunks);
2. `runner.execute(...)` runs them as one flat batch and samples where a chunk reaches the end;
3. `scheduler.update_from_output(...)` appends tokens and finishes on eos / stop ids / length;
4. the engine detokenizes the new tokens and finishes requests whose text hit a stop string.
Times come from `time.monotonic` (`LLMEngine.now`), so arrival times given by callers must too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.attention.backend import create_backend
from engine.config import EngineConfig
from engine.detokenizer import DetokenizerState, advance, release
from engine.host_memory import retain_freed_host_memory
from engine.kv_cache import CacheGeometry, KVCache
from engine.model.arch import LlamaArch
from engine.model.loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from predictor.base import Prediction
from scheduler.output import PromptLogprobs, SchedulerOutput, TokenLogprobs
from scheduler.request import ChoiceGroup, Request, RequestStatus, SamplingParams, Tier
from scheduler.scheduler import Scheduler
from scheduler.step import ends_sequence
from scheduler.step import SchedulerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """What one step did and cost; the step-cost calibration fits its times."""

    num_batched_tokens: int
    num_seqs: int
    sum_context_tokens: int  # context length after the step, summed over its sequences
    step_time_s: float
    forward_time_s: float


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    num_steps: int
    step_time_s: float  # cumulative wall time inside step()
    forward_time_s: float  # cumulative model forward time (the rest is overhead)
    num_generated_tokens: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cache_geometry(config: EngineConfig, arch: LlamaArch, dtype: torch.dtype) -> CacheGeometry:
    """The KV block geometry of a model of `arch` served with `config`, in `dtype`."""
    return CacheGeometry(arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, dtype)


def gpu_block_count(config: EngineConfig, geometry: CacheGeometry) -> int:
    """KV blocks on the device: `num_gpu_blocks` when set, else what `kv_cache_memory_gib` holds."""
    return config.num_gpu_blocks or geometry.blocks_for(config.kv_cache_memory_gib)


def check_model_dir(model_dir: str | Path) -> None:
    """FileNotFoundError unless `model_dir` is a converted model folder. Checked before transformers
    sees the path: it takes a missing folder's name for a hub repo id, and fails with a message
    about repo ids or waits on the network."""
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no converted model at {model_dir} (run `make model`)")


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    check_model_dir(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.retain_host_memory:
            retain_freed_host_memory()
        self.device = resolve_device(config.device)
        # What the folder's config.json can refute is checked before the weights load.
        check_model_dir(config.model)
        self.arch = LlamaArch.from_model_dir(config.model)
        if config.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"{self.arch.max_position_embeddings} positions")
        backend = create_backend(config.attention_backend, self.device, self.arch.num_heads // self.arch.num_kv_heads)
        self.kv_cache = self._make_cache(getattr(torch, config.dtype))
        self.tokenizer = load_tokenizer(config.model)
        model = load_model(config.model, config.dtype, self.device, config.max_model_len)
        self.runner = ModelRunner(model, self.kv_cache, backend, Sampler(config.seed), self.device)
        self.scheduler = Scheduler(config.scheduler_config(self.kv_cache.num_gpu_blocks, self.kv_cache.num_cpu_blocks))
        self.eos_token_id = self.tokenizer.eos_token_id
        # A checkpoint may end a reply with several ids (config.json and generation_config.json, as in
        # Llama 3); the tokenizer names one. The others stop a request like it, unless ignore_eos.
        self.extra_eos_token_ids = tuple(i for i in self.arch.eos_token_ids if i != self.eos_token_id)
        self.predictor = None
        if config.predictor is not None:
            from predictor.saved import load as load_predictor

            self.predictor = load_predictor(config.predictor)
        self._detokenizers: dict[str, DetokenizerState] = {}
        self._num_reported: dict[str, int] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}  # requests that asked for them
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}  # likewise, by prompt position
        self._num_steps, self._step_time_s, self._forward_time_s, self._num_generated = 0, 0.0, 0.0, 0
        self.last_step: StepRecord | None = None
        log.info("engine ready: %s on %s, attention %s", config.model, self.device, self.runner.backend.name)

    def _make_cache(self, dtype: torch.dtype) -> KVCache:
        config = self.config
        geometry = cache_geometry(config, self.arch, dtype)
        num_gpu_blocks = gpu_block_count(config, geometry)
        if num_gpu_blocks <= 0:
            raise ValueError(f"kv_cache_memory_gib {config.kv_cache_memory_gib} holds no KV block")
        num_cpu_blocks = geometry.blocks_for(config.swap_space_gib) if config.preemption_mode == "swap" else 0
        if config.preemption_mode == "swap" and num_cpu_blocks <= 0:
            raise ValueError(f"swap_space_gib {config.swap_space_gib} holds no KV block")
        cache = KVCache(geometry, num_gpu_blocks, num_cpu_blocks, self.device)
        cache.log_capacity(config.max_model_len)
        return cache

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # ---- requests ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text the model expects for a chat, ending with the assistant's turn."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            # The exact model input: offline callers (generate's chat, trace) pass chat-templated
            # text, whose special tokens a second BOS would duplicate. The HTTP server's plain
            # completions add them, as vLLM's do.
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.arch.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.arch.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than the context: it must be "
                             f"shorter than max_model_len {self.config.max_model_len}")
        return ids

    def _check_sampler_token_ids(self, params: SamplingParams) -> None:
        """The token ids logit_bias, allowed_token_ids and bad words name must index the logits, and an
        allowed set must hold a token that min_tokens lets the model generate."""
        vocab = self.arch.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word])):
            outside = sorted({t for t in ids if t >= vocab})
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary of {vocab}: {outside[:5]}")
        if params.allowed_token_ids and params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
            if stops.issuperset(params.allowed_token_ids):
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens rules out")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    tier: Tier = Tier.STANDARD, priority: int = 0, arrival_time: float | None = None,
                    prediction: Prediction | None = None, true_len: int | None = None,
                    group: ChoiceGroup | None = None) -> None:
        """Queue a request; ValueError on bad input (AdmissionRejected when shed by admission control).
        `group`: the API request whose choices it is one of (admission judges them together)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_ids(prompt)
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        self._check_sampler_token_ids(params)
        if prediction is None and self.predictor is not None:
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(token_ids)
            prediction = self.predictor.predict([text])[0]
        now = self.now()
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=now if arrival_time is None else arrival_time, eos_token_id=self.eos_token_id,
            tier=Tier(tier), priority=priority, true_len=true_len,
            predicted_len=None if prediction is None else prediction.point,
            predicted_p50=None if prediction is None else prediction.p50,
            predicted_p90=None if prediction is None else prediction.p90,
            predicted_rank_len=None if prediction is None else prediction.rank_len, group=group)
        self.scheduler.add_request(request, now)
        self._detokenizers[request_id] = DetokenizerState.for_prompt(token_ids, params.skip_special_tokens)
        self._num_reported[request_id] = 0
        if params.logprobs is not None:
            self._logprobs[request_id] = []
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]  # the first token has nothing before it

    def abort_request(self, request_id: str) -> bool:
        aborted = self.scheduler.abort_request(request_id, self.now())
        self._release(request_id)
        return aborted

    def _release(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._num_reported.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.now()
        output: SchedulerOutput = self.scheduler.schedule(start)
        try:
            runner_output = self.runner.execute(output, self.scheduler.get_request, self._prompt_logprobs_held)
            done = self.now()
            # Inside the guard too: an interrupt while tokens are appended leaves some requests
            # with every token computed and none sampled, which no later step would schedule.
            progressed = self.scheduler.update_from_output(output, runner_output, done)
        except BaseException:
            self.scheduler.restart_failed_step(output, self.now())  # no request stranded mid-step (Ctrl-C, OOM)
            raise
        self.scheduler.record_step(done, output.num_batched_tokens, done - start)
        self._add_prompt_logprobs(runner_output.prompt_logprobs)
        outputs = [self._report(request, done, runner_output.logprobs) for request in progressed]
        step_time = self.now() - start
        self._num_steps += 1
        self._step_time_s += step_time
        self._forward_time_s += self.runner.last_times.forward_s
        self.last_step = StepRecord(
            output.num_batched_tokens, len(output.chunks),
            sum(c.start_position + len(c.token_ids) for c in output.chunks), step_time,
            self.runner.last_times.forward_s)
        return outputs

    def _report(self, request: Request, now: float, step_logprobs: dict[str, TokenLogprobs]) -> RequestOutput:
        request_id = request.request_id
        state = self._detokenizers[request_id]
        new_ids = request.output_token_ids[self._num_reported[request_id]:]
        logprobs = self._logprobs.get(request_id)
        if logprobs is not None and new_ids:
            logprobs = self._add_logprobs(request_id, new_ids, step_logprobs)
        self._num_reported[request_id] = request.num_output_tokens
        self._num_generated += len(new_ids)
        stops, keep_stop = request.sampling_params.stop, request.sampling_params.include_stop_str_in_output
        # As in vLLM, a token that stopped the request (end of sequence, or one of stop_token_ids)
        # counts in token_ids and usage but not in the text, unless include_stop_str_in_output.
        # Stop strings are found below, so FINISHED_STOPPED here means a stop token.
        token_stop = request.status is RequestStatus.FINISHED_STOPPED and bool(new_ids)
        text_ids = new_ids[:-1] if token_stop and not keep_stop else new_ids
        # As in vLLM, stop strings are searched for only once the output is past min_tokens (the
        # held-back tail below still counts every stop string).
        searched = stops if request.num_output_tokens > request.sampling_params.min_tokens else ()
        stop_string = advance(self.tokenizer, state, text_ids, searched, final=request.is_finished,
                              keep_stop=keep_stop)
        if stop_string is not None and not request.is_finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, now)
        # A stop string that came with the last allowed token cut the text as one found earlier
        # does, so the reason is "stop" there too (the scheduler, which owns the request, had
        # already finished it by length).
        finish_reason = "stop" if stop_string is not None else request.status.finish_reason
        # A token's stop comes first, as vLLM checks the token before the text.
        stop_reason = _token_stop_reason(request, new_ids[-1]) if token_stop else stop_string
        new_text = release(state, stops, request.is_finished, keep_stop)
        prompt_logprobs = self._reported_prompt_logprobs(request)
        if request.is_finished:
            self._release(request_id)
        return RequestOutput(
            request_id=request_id, prompt_token_ids=tuple(request.prompt_token_ids),
            token_ids=tuple(request.output_token_ids), new_token_ids=tuple(new_ids), text=state.text[:state.released],
            new_text=new_text, finished=request.is_finished, finish_reason=finish_reason,
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time, num_preemptions=request.num_preemptions, report_time=now,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=prompt_logprobs, stop_reason=stop_reason)

    def _reported_prompt_logprobs(self, request: Request) -> tuple[TokenLogprobs | None, ...] | None:
        """A request's prompt logprobs once every position has them (its first token is sampled
        only after the whole prompt is prefilled, so every output carries them whole)."""
        known = self._prompt_logprobs.get(request.request_id)
        return tuple(known) if known is not None and len(known) == request.num_prompt_tokens else None

    def _prompt_logprobs_held(self, request_id: str) -> int:
        return len(self._prompt_logprobs.get(request_id, ()))

    def _add_prompt_logprobs(self, found: dict[str, PromptLogprobs]) -> None:
        """Extend each request's prompt logprobs with the positions it did not have. The runner
        scores only those (a prefill recomputed after a preemption skips the held ones); should a
        position come again, the first score is kept."""
        for request_id, chunk in found.items():
            known = self._prompt_logprobs.get(request_id)
            if known is None:
                continue  # finished or aborted meanwhile
            if chunk.first_position > len(known):  # chunks come in order, so never: a gap would misplace them
                log.error("request %s: prompt logprobs from position %d, after only %d; it reports none",
                          request_id, chunk.first_position, len(known))
                del self._prompt_logprobs[request_id]
                continue
            known.extend(chunk.entries[len(known) - chunk.first_position:])

    def _add_logprobs(self, request_id: str, new_ids: list[int],
                      step_logprobs: dict[str, TokenLogprobs]) -> list[TokenLogprobs] | None:
        """The request's logprobs with those of the one token it gained this step (a request samples
        at most one token a step, and a recomputed request keeps its tokens and so their logprobs).
        Should that ever not hold, the request goes on without logprobs, not the engine down."""
        logprobs = self._logprobs[request_id]
        entry = step_logprobs.get(request_id)
        if len(new_ids) == 1 and entry is not None and entry.token_id == new_ids[0]:
            logprobs.append(entry)
            return logprobs
        log.error("request %s gained tokens %s without their logprobs; it reports none from now on",
                  request_id, new_ids)
        del self._logprobs[request_id]
        return None

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.stats(self.now()), self._num_steps, self._step_time_s,
                           self._forward_time_s, self._num_generated)


def _token_stop_reason(request: Request, token: int) -> int | None:
    """vLLM's stop_reason for a request a token stopped: none for the end-of-sequence token (which
    stop_status checks first), else the token of stop_token_ids itself."""
    return None if ends_sequence(request, token) else token
