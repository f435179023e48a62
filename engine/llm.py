"""Offline API: `LLM(...).generate(prompts, sampling_params) -> list[RequestOutput]`.

All prompts are queued at once and the engine steps until every one has finished, so they share
batches through continuous batching; results come back in the order of the prompts. Every prompt is
validated before any is run: bad input raises ValueError and leaves nothing queued. As in vLLM, a
prompt is a text, a list of token ids (NumPy's too), or a mapping {"prompt": text} /
{"prompt_token_ids": ids}, optionally with a "cache_salt"; `priority` gives each prompt its priority
(lower first, under the `priority` policy). `chat(messages)` renders conversations with the model's
chat template first. A result is one RequestOutput per prompt, whose `outputs` lists its
SamplingParams' n sequences, as vLLM's does: choice i is a request of its own, seeded seed + i,
and the n are judged by admission as one group, as the server makes them.
"""

from __future__ import annotations

import itertools
from dataclasses import fields, replace
from typing import Any, Mapping, Sequence

from pydantic import ValidationError
from tqdm import tqdm

from engine.chat_messages import ChatMessage
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from scheduler.request import ChoiceGroup, SamplingParams, is_int, listed, member_ids, plain_number

Prompt = str | list[int]
ParamsLike = SamplingParams | Mapping[str, Any]
# vLLM's TextPrompt ({"prompt"}) and TokensPrompt ({"prompt_token_ids"}, whose "prompt" may name the
# text the ids came from, and is then not read), each with an optional cache_salt.
PROMPT_KEYS = ("prompt", "prompt_token_ids")
OPTIONAL_PROMPT_KEYS = ("cache_salt",)


def _as_prompt(prompt: Any) -> tuple[Any, str | None]:
    """A prompt as the text or ids it holds, with the cache salt of a vLLM prompt mapping;
    anything else as it is (add_request checks it)."""
    prompt = listed(prompt)
    return _mapping_prompt(prompt) if isinstance(prompt, Mapping) else (prompt, None)


def _mapping_prompt(prompt: Mapping[str, Any]) -> tuple[str | list[int], str | None]:
    """A vLLM prompt mapping's text or ids, and its cache salt; each key must hold its own kind (a
    mapping inside one would lose its salt)."""
    keys = set(map(str, prompt))
    unknown = sorted(keys - set(PROMPT_KEYS) - set(OPTIONAL_PROMPT_KEYS))
    if unknown or not keys & set(PROMPT_KEYS):
        raise ValueError(f"a prompt mapping holds prompt or prompt_token_ids (and optionally cache_salt), got keys "
                         f"{sorted(keys)}; sampling settings go in SamplingParams")
    if "prompt_token_ids" in prompt:
        ids = listed(prompt["prompt_token_ids"])
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return ids, prompt.get("cache_salt")
    if not isinstance(prompt["prompt"], str):
        raise ValueError(f"a prompt mapping's prompt must be a text (ids go in prompt_token_ids), got "
                         f"{type(prompt['prompt']).__name__}")
    return prompt["prompt"], prompt.get("cache_salt")


def _with_salt(params: SamplingParams, salt: str | None) -> SamplingParams:
    """A prompt mapping's cache_salt set on its sampling params (where the scheduler reads it)."""
    if salt is None or salt == params.cache_salt:
        return params
    if params.cache_salt is not None:
        raise ValueError(f"cache_salt {salt!r} in a prompt mapping, and {params.cache_salt!r} in its SamplingParams")
    return replace(params, cache_salt=salt)  # SamplingParams checks the salt


def _as_conversation(value: Any) -> Any:
    """A conversation's messages as the chat template reads them, taken as the server takes them
    (engine/chat_messages.py: text parts joined, `developer` as `system`); ValueError naming the
    first bad message. Anything but a list is left to apply_chat_template to refuse."""
    if not isinstance(value, (list, tuple)):
        return value  # apply_chat_template refuses it, as it refuses an empty conversation
    messages = []
    for index, message in enumerate(value):
        try:
            messages.append(ChatMessage.model_validate(message).for_template())
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(map(str, error["loc"]))
            raise ValueError(f"message {index}: {where + ': ' if where else ''}"
                             f"{error['msg'].removeprefix('Value error, ')}") from None
    return messages


def _is_token_id(value: Any) -> bool:
    return is_int(plain_number(value))


def _as_params(params: ParamsLike | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        try:
            return SamplingParams(**params)  # SamplingParams validates values (ValueError)
        except TypeError as error:  # an unknown key
            raise ValueError(f"bad sampling params: {error}") from None
    raise ValueError(f"sampling params must be SamplingParams or a mapping, got {type(params).__name__}")


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **config_fields: Any) -> None:
        if config is None:
            if model is not None:
                config_fields["model"] = model
            unknown = sorted(set(config_fields) - {field.name for field in fields(EngineConfig)})
            if unknown:  # vLLM's options this engine lacks (tensor_parallel_size, ...), or typos
                raise ValueError(f"LLM: no option {', '.join(unknown)} here; the options are EngineConfig's fields")
            config = EngineConfig(**config_fields)
        elif model is not None or config_fields:
            raise ValueError("pass either an EngineConfig or config fields, not both")
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's name for `tokenizer`."""
        return self.engine.tokenizer

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: ParamsLike | Sequence[ParamsLike] | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's: one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered by the model's chat template, then generated as `generate` does. Every
        conversation is rendered before any is queued, so a bad one leaves nothing queued."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a conversation or a list of conversations, got {messages!r}")
        conversations = [messages] if isinstance(messages[0], Mapping) else messages
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a mapping, got {type(chat_template_kwargs).__name__}")
        # As vLLM merges the template's variables over the switches, theirs win.
        variables = dict(chat_template_kwargs or {})
        switches = {"add_generation_prompt": variables.pop("add_generation_prompt", add_generation_prompt),
                    "continue_final_message": variables.pop("continue_final_message", continue_final_message)}
        prompts = [self.engine.apply_chat_template(_as_conversation(conversation), template_variables=variables,
                                                   **switches)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _normalise(self, prompts: Prompt | Sequence[Prompt],
                   params: ParamsLike | Sequence[ParamsLike] | None) -> tuple[list[Prompt], list[SamplingParams]]:
        prompts = listed(prompts)  # an array of ids is one prompt; of rows, one per row
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0]):
            prompts = [list(prompts)]  # one prompt of token ids
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a string, a list of token ids, a prompt mapping, or a list of "
                             f"those; got {type(prompts).__name__}")
        prompts, salts = zip(*map(_as_prompt, prompts)) if prompts else ((), ())
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            params_list = [_as_params(p) for p in params]
        else:
            params_list = [_as_params(params)] * len(prompts)
        return list(prompts), [_with_salt(p, salt) for p, salt in zip(params_list, salts)]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: ParamsLike | Sequence[ParamsLike] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        prompts, params_list = self._normalise(prompts, sampling_params)
        priority = [0] * len(prompts) if priority is None else [plain_number(rank) for rank in priority]
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        elif any(priority) and not self.engine.scheduler.policy.orders_by_priority:
            # As vLLM and the server answer: under another policy they would be silently ignored.
            raise ValueError(f"priority: this engine schedules by {self.engine.scheduler.policy.name}, not by "
                             "priority (policy='priority')")
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        predictions = self.engine.predict(prompts)  # in batches, not one predictor call per prompt
        # Each prompt's choices as engine requests, named as the server names them.
        choices = {request_id: member_ids(request_id, params.n)
                   for request_id, params in zip(request_ids, params_list)}
        added: list[str] = []
        try:
            for request_id, prompt, request_params, prediction, rank in zip(request_ids, prompts, params_list,
                                                                            predictions, priority):
                self._add_choices(request_id, choices[request_id], prompt, request_params, prediction, rank, added)
        except BaseException:  # a bad prompt, or Ctrl-C while queueing: none of these will be collected
            for sequence_id in added:
                self.engine.abort_request(sequence_id)
            raise
        finished = self._run_to_completion(choices, use_tqdm)
        return [_gathered(request_id, prompt, [finished[choice_id] for choice_id in choices[request_id]])
                for request_id, prompt in zip(request_ids, prompts)]

    def _add_choices(self, request_id: str, choice_ids: list[str], prompt: Prompt, params: SamplingParams,
                     prediction: Any, rank: int, added: list[str]) -> None:
        """Queue a prompt's n choices, each a request (params.choice(i): seed + i), judged by
        admission as one group, as the server queues them; `added` lists each as it is queued."""
        group = None if params.n == 1 else ChoiceGroup(request_id, params.n)
        for index, sequence_id in enumerate(choice_ids):
            added.append(sequence_id)  # first: a Ctrl-C right after the add must still abort it
            self.engine.add_request(sequence_id, prompt, params.choice(index), prediction=prediction, priority=rank,
                                    group=group)

    def _run_to_completion(self, choices: dict[str, list[str]], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until every prompt's choices (their engine request ids, by prompt) have finished;
        each choice's final output. The progress bar counts prompts, as vLLM's does."""
        prompt_of = {choice_id: request_id for request_id, ids in choices.items() for choice_id in ids}
        sequence_ids = list(prompt_of)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(choices), desc="generate", unit="prompt", disable=not use_tqdm)
        try:
            while len(finished) < len(sequence_ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in prompt_of:  # not one queued by hand
                        finished[output.request_id] = output
                        if all(choice_id in finished for choice_id in choices[prompt_of[output.request_id]]):
                            progress.update()  # the prompt's last choice
        except BaseException:
            # Interrupted (Ctrl-C) or failed: nobody will collect these, so free their blocks.
            for sequence_id in sequence_ids:
                if sequence_id not in finished:
                    self.engine.abort_request(sequence_id)
            raise
        finally:
            progress.close()
        return finished


def _gathered(request_id: str, prompt: Prompt, choices: list[RequestOutput]) -> RequestOutput:
    """A prompt's choices as one RequestOutput under its id, as vLLM returns them: the first
    choice's fields, `outputs` listing every choice in order, and the prompt's text."""
    more = tuple(choice.as_completion(index) for index, choice in enumerate(choices) if index)
    return replace(choices[0], request_id=request_id, more_outputs=more,
                   prompt=prompt if isinstance(prompt, str) else None)
