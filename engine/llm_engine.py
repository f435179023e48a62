"""The engine's step loop: schedule -> execute -> update -> report.

`LLMEngine` owns the tokenizer, the model runner (model, KV cache, attention backend, sampler) and
the scheduler. One `step()`:
1. `scheduler.schedule(now)` picks the chunks of this step (any urgent admission first, then the
   running requests by tier, decodes before prefill chunks, then new prefill chunks);
2. `runner.execute(...)` runs them as one flat batch and samples where a chunk reaches the end;
3. `scheduler.update_from_output(...)` appends tokens and finishes on eos / stop ids / length;
4. the output processor (`engine/output_processor.py`) detokenizes the new tokens, finishes
   requests whose text hit a stop string, and makes each progressed request's `RequestOutput`.
Times come from `time.monotonic` (`LLMEngine.now`), so arrival times given by callers must too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.attention.backend import create_backend
from engine.chat_messages import reserved_variables
from engine.config import EngineConfig
from engine.host_memory import retain_freed_host_memory
from engine.kv_cache import CacheGeometry, KVCache
from engine.model.arch import LlamaArch
from engine.model.loader import load_model
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from predictor.base import Prediction
from predictor.batching import predict_in_batches
from scheduler.eviction import needs_host_pool
from scheduler.output import SchedulerOutput
from scheduler.request import ChoiceGroup, Request, SamplingParams, Tier, has_utf8_form, is_int, plain_number
from scheduler.scheduler import Scheduler
from scheduler.step import SchedulerStats

log = logging.getLogger(__name__)

PREDICT_BATCH = 32  # prompts scored at once by `predict`: the batch the predictors' latency is timed at


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


def resolve_dtype(name: str, device: torch.device) -> str:
    """vLLM's `auto` dtype, here by device: float32 on a CPU, where this project's tests and
    figures run (and Triton's interpreter mishandles bf16); on a GPU, bfloat16 (SmolLM2's own) where
    the GPU has it, else float16."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def config_dtype(config: EngineConfig) -> torch.dtype:
    """The torch dtype `config` asks for, "auto" resolved for its device as the engine resolves it."""
    return getattr(torch, resolve_dtype(config.dtype, resolve_device(config.device)))


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
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError) as exc:  # transformers' message names no folder, nor what is missing
        raise ValueError(f"{model_dir}: its tokenizer does not load (run `make model`): {exc}") from None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.retain_host_memory:
            retain_freed_host_memory()
        self.device = resolve_device(config.device)
        if config.dtype == "auto":  # what it resolves to is what the engine reports
            self.config = config = replace(config, dtype=resolve_dtype(config.dtype, self.device))
        # What the folder's config.json can refute is checked before the weights load.
        check_model_dir(config.model)
        self.arch = LlamaArch.from_model_dir(config.model)
        if config.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"{self.arch.max_position_embeddings} positions (set it at most that: "
                             "--max-model-len)")
        dtype = getattr(torch, config.dtype)  # "auto" resolved above
        backend = create_backend(config.attention_backend, self.device, self.arch.num_heads // self.arch.num_kv_heads,
                                 dtype)
        self.tokenizer = load_tokenizer(config.model)
        model = load_model(config.model, config.dtype, self.device, config.max_model_len)
        # The cache after the weights, as vLLM sizes it: checked against the memory they left, a cache
        # that fit only before them passed the check and then ran the weights' load out of memory.
        self.kv_cache = self._make_cache(dtype)
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
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        self._num_steps, self._step_time_s, self._forward_time_s = 0, 0.0, 0.0
        self._time_between_steps_s = 0.0  # charged to the next step's measured time (admission's rates)
        self.last_step: StepRecord | None = None
        log.info("engine ready: %s on %s, attention %s", config.model, self.device, self.runner.backend.name)

    def _make_cache(self, dtype: torch.dtype) -> KVCache:
        config = self.config
        geometry = cache_geometry(config, self.arch, dtype)
        num_gpu_blocks = gpu_block_count(config, geometry)
        if num_gpu_blocks <= 0:
            raise ValueError(f"kv_cache_memory_gib {config.kv_cache_memory_gib} holds no KV block")
        host_pool = needs_host_pool(config.preemption_mode)
        num_cpu_blocks = geometry.blocks_for(config.swap_space_gib) if host_pool else 0
        if host_pool and num_cpu_blocks <= 0:
            raise ValueError(f"swap_space_gib {config.swap_space_gib} holds no KV block")
        # An error about the device pool names the setting that sized it.
        device_setting = "kv_cache_memory_gib" if config.num_gpu_blocks is None else "num_gpu_blocks"
        cache = KVCache(geometry, num_gpu_blocks, num_cpu_blocks, self.device, device_setting)
        cache.log_capacity(config.max_model_len)
        return cache

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # ---- requests ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_variables: dict[str, Any] | None = None) -> str:
        """The prompt text the model expects for a chat, by default ending with the assistant's
        turn opened; ValueError (naming `messages`) when the template refuses the conversation.
        The variables come as one dict: spread as keywords, a name such as "messages" clashed
        with this method's own (a TypeError)."""
        reserved = reserved_variables(template_variables)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (how the conversation is "
                             "rendered is the chat call's to say)")
        if add_generation_prompt and continue_final_message:  # vLLM refuses the pair too
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set: the "
                             "first opens a new assistant turn, the second continues the last message")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_variables or {}))
        except Exception as exc:  # noqa: BLE001 - the conversation's fault (a template raising, a bad role)
            raise ValueError(f"messages: {exc}") from exc

    @staticmethod
    def _checked_text(prompt: str) -> str:
        """A text prompt the tokenizer takes: not empty, and valid Unicode (bytes that are not
        UTF-8, from a command line, come as lone surrogates, which the tokenizer refused with a
        TypeError)."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        if not has_utf8_form(prompt):
            raise ValueError("prompt is not valid Unicode text (a lone UTF-16 surrogate: bytes that are not UTF-8)")
        return prompt

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._checked_text(prompt)
            # The exact model input: offline callers (generate's chat, trace) pass chat-templated
            # text, whose special tokens a second BOS would duplicate. The HTTP server's plain
            # completions add them, as vLLM's do.
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            ids = list(map(plain_number, prompt))  # NumPy's integers too, as Python's
            if any(not is_int(t) or not 0 <= t < self.arch.vocab_size for t in ids):  # True is no token
                raise ValueError(f"prompt token ids must be integers in [0, {self.arch.vocab_size})")
        else:
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than the context: it must be "
                             f"shorter than max_model_len {self.config.max_model_len}")
        return ids

    def _check_sampler_token_ids(self, params: SamplingParams) -> None:
        """The token ids logit_bias, allowed_token_ids and bad words name must index the logits, and an
        allowed set must hold a token that min_tokens and the one-token bad words let the model
        generate: with none, every logit is -inf, and the sampler drew a token the set excludes. (A
        longer bad word can still rule out the rest of a set once its first tokens are generated;
        that depends on the output and is not checked, as vLLM does not check it.)"""
        vocab = self.arch.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word])):
            outside = sorted({t for t in ids if t >= vocab})
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary of {vocab}: {outside[:5]}")
        if not params.allowed_token_ids:
            return
        # min_tokens rules the end tokens out under ignore_eos too.
        stops = ({*params.stop_token_ids, self.eos_token_id, *self.extra_eos_token_ids} if params.min_tokens
                 else set())
        if stops.issuperset(params.allowed_token_ids):
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens rules out")
        banned = stops | {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError("allowed_token_ids: every allowed token is a one-token bad word"
                             + (" or a stop token, which min_tokens rules out" if params.min_tokens else ""))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    tier: Tier = Tier.STANDARD, priority: int = 0, arrival_time: float | None = None,
                    prediction: Prediction | None = None, true_len: int | None = None,
                    group: ChoiceGroup | None = None) -> None:
        """Queue a request; ValueError on bad input (AdmissionRejected when shed by admission control).
        `group`: the API request whose choices it is one of (admission judges them together)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:  # LLM.generate and the server add choice i as params.choice(i)
            raise ValueError(f"n={params.n}: an engine request is one sequence; add each choice as a request "
                             "(SamplingParams.choice), or use LLM.generate")
        token_ids = self._prompt_ids(prompt)
        if params.max_tokens is None:  # vLLM's: up to the end of the context (min_tokens within it)
            room = self.config.max_model_len - len(token_ids)
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        self._check_sampler_token_ids(params)
        if prediction is None and self.predictor is not None:
            prediction = self.predict([prompt])[0]
        now = self.now()
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=now if arrival_time is None else arrival_time, eos_token_id=self.eos_token_id,
            extra_eos_token_ids=self.extra_eos_token_ids,
            tier=Tier(tier), priority=priority, true_len=true_len,
            predicted_len=None if prediction is None else prediction.point,
            predicted_p50=None if prediction is None else prediction.p50,
            predicted_p90=None if prediction is None else prediction.p90,
            predicted_rank_len=None if prediction is None else prediction.rank_len, group=group)
        self.scheduler.add_request(request, now)
        self.output_processor.add(request_id, token_ids, params)

    def predict(self, prompts: Sequence[str | list[int]]) -> list[Prediction | None]:
        """Each prompt's predicted length, scored in batches; all None without a predictor or when
        it fails, which serves them on with their lengths unknown to the policy, as the server
        does. Text and token ids are checked (ValueError) before they are scored: a text the
        tokenizer refuses failed the whole batch's scoring."""
        if self.predictor is None or not prompts:
            return [None] * len(prompts)
        texts = [self._checked_text(prompt) if isinstance(prompt, str)
                 else self.tokenizer.decode(self._prompt_ids(prompt)) for prompt in prompts]
        try:
            return predict_in_batches(self.predictor, texts, batch_size=PREDICT_BATCH)
        except Exception:  # noqa: BLE001 - a length estimate is never worth a request
            log.exception("predictor failed on %d prompts; they are served without a prediction", len(texts))
            return [None] * len(prompts)

    def abort_request(self, request_id: str) -> bool:
        aborted = self.scheduler.abort_request(request_id, self.now())
        self.output_processor.release(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.now()
        output: SchedulerOutput = self.scheduler.schedule(start)
        try:
            runner_output = self.runner.execute(output, self.scheduler.get_request,
                                               self.output_processor.prompt_logprobs_held)
            done = self.now()
            # Inside the guard too: an interrupt while tokens are appended leaves some requests
            # with every token computed and none sampled, which no later step would schedule.
            progressed = self.scheduler.update_from_output(output, runner_output, done)
        except BaseException:
            self.scheduler.restart_failed_step(output, self.now())  # no request stranded mid-step (Ctrl-C, OOM)
            raise
        # The rates admission estimates delays with are what the engine thread achieves, the
        # commands and inline prediction applied between steps included.
        self.scheduler.record_step(done, output.num_batched_tokens, done - start + self._time_between_steps_s)
        self._time_between_steps_s = 0.0
        self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        outputs = [self.output_processor.report(request, done, runner_output.logprobs) for request in progressed]
        step_time = self.now() - start
        self._num_steps += 1
        self._step_time_s += step_time
        self._forward_time_s += self.runner.last_times.forward_s
        self.last_step = StepRecord(
            output.num_batched_tokens, len(output.chunks),
            sum(c.start_position + len(c.token_ids) for c in output.chunks), step_time,
            self.runner.last_times.forward_s)
        return outputs

    def charge_time_between_steps(self, seconds: float) -> None:
        """Engine-thread time spent between steps while requests were running (a round of
        commands: admissions, aborts, inline length prediction), in which no token moved: the next
        step's measured time, which admission's token rates come from, includes it."""
        self._time_between_steps_s += seconds

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.stats(self.now()), self._num_steps, self._step_time_s,
                           self._forward_time_s, self.output_processor.num_generated_tokens)

