"""Turns a SchedulerOutput into tensors, runs the model and samples.

Per step: apply the swap copies (out or in: the scheduler never swaps in during a step that swapped
out, and no order of the two would be safe, since a swap-out may write the host block a swap-in
frees and a swap-in the device block a swap-out frees; a step with both is refused), flatten every
chunk into one [N] token batch with positions and slot mapping, build the AttentionMetadata once
(every layer shares it), run the forward, and compute logits only at the last row of each chunk
that samples (and at the prompt rows of requests that ask for prompt logprobs). The sampled rows
pass the logits processors their requests ask for (logits_processors.py: allowed tokens,
min_tokens, logit bias, penalties), then are sampled; logprobs, where asked for, come from the raw
logits. Tensors are built from a handful of vectorised ops per step, never per token or per layer.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.llama import LlamaModel
from engine.logits_processors import default_processors, process_logits
from engine.sampler import Sampler, token_logprobs
from scheduler.output import ModelRunnerOutput, PromptLogprobs, ScheduledChunk, SchedulerOutput
from scheduler.request import Request


# Prompt positions per LM-head call when a request asks for prompt logprobs: 256 rows of a
# 49k vocabulary are 50 MB of float32 logits, and a prefill chunk may hold thousands of rows.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S] rows of the flat batch whose logits are sampled
    sample_request_ids: tuple[str, ...]  # [S]
    sample_positions: tuple[int, ...]  # [S] the position of each sampled token (tokens before it)


@dataclass
class StepTimes:
    """Seconds of the last step, split so the benchmark can report the overhead share."""

    prepare_s: float = 0.0  # swaps and tensor building
    forward_s: float = 0.0  # the model forward: layers (attention included) and the LM head
    sample_s: float = 0.0  # sampling


def build_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device) -> StepBatch:
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_position for c in chunks]
    query_start_loc = tuple(itertools.accumulate(q_lens, initial=0))
    seq_lens = tuple(s + n for s, n in zip(starts, q_lens))
    width = max(len(c.block_ids) for c in chunks)
    table_rows = [list(c.block_ids) + [0] * (width - len(c.block_ids)) for c in chunks]
    block_tables = torch.tensor(table_rows, dtype=torch.int32, device=device)
    positions = torch.tensor(list(itertools.chain.from_iterable(range(s, e) for s, e in zip(starts, seq_lens))),
                             dtype=torch.int64, device=device)
    seq_index = torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                        torch.tensor(q_lens, device=device))
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + positions % block_size
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables, slot_mapping=slot_mapping, block_size=block_size,
        query_start_loc_host=query_start_loc, seq_lens_host=seq_lens)
    sampling = [(query_start_loc[b + 1] - 1, c.request_id, seq_lens[b]) for b, c in enumerate(chunks) if c.sample]
    input_ids = torch.tensor(list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
                             dtype=torch.int64, device=device)
    return StepBatch(input_ids, positions, metadata,
                     torch.tensor([row for row, _, _ in sampling], dtype=torch.int64, device=device),
                     tuple(request_id for _, request_id, _ in sampling),
                     tuple(position for _, _, position in sampling))


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend, sampler: Sampler,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.backend, self.sampler = model, kv_cache, backend, sampler
        self.device = device
        self.block_size = kv_cache.geometry.block_size
        self.last_times = StepTimes()
        self.logits_processors = default_processors()  # they keep per-request tensors between steps

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, request_of: Callable[[str], Request],
                prompt_logprobs_held: Callable[[str], int] = lambda request_id: 0) -> ModelRunnerOutput:
        """`request_of` reads a scheduled request (its sampling parameters and, for the logits
        processors, its tokens); the runner never changes it. `prompt_logprobs_held` says how many
        prompt positions' logprobs a request already has (a prefill recomputed after a preemption
        need not score them again)."""
        start = self._clock()
        if output.swap_out and output.swap_in:
            raise ValueError("a step may swap out or swap in, not both (a freed block may be the other's)")
        self.kv_cache.swap_out(output.swap_out)
        self.kv_cache.swap_in(output.swap_in)
        if output.is_empty:
            self.last_times = StepTimes(prepare_s=self._clock() - start)
            return ModelRunnerOutput(sampled_token_ids={})
        batch = build_batch(output.chunks, self.block_size, self.device)
        plan = self.backend.prepare(batch.metadata)
        prepared = self._clock()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.layers, batch.metadata, self.backend, plan)
        # The LM head is part of the model's work; it runs on the sampled rows only.
        logits = self.model.compute_logits(hidden[batch.sample_rows]) if batch.sample_request_ids else None
        forwarded = self._clock()
        sampled: dict[str, int] = {}
        logprobs = {}
        if logits is not None:
            requests = [request_of(request_id) for request_id in batch.sample_request_ids]
            params = [request.sampling_params for request in requests]
            processed = process_logits(logits, requests, self.logits_processors)
            tokens = self.sampler.sample(processed, batch.sample_positions, params)
            sampled = dict(zip(batch.sample_request_ids, tokens))
            asked = token_logprobs(logits, tokens, [p.logprobs for p in params])
            logprobs = {rid: entry for rid, entry in zip(batch.sample_request_ids, asked) if entry is not None}
        prompt_logprobs = self._prompt_logprobs(hidden, output.chunks, batch.metadata.query_start_loc_host, request_of,
                                                prompt_logprobs_held)
        self.last_times = StepTimes(prepared - start, forwarded - prepared, self._clock() - forwarded)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk], query_starts: Sequence[int],
                         request_of: Callable[[str], Request],
                         held: Callable[[str], int]) -> dict[str, PromptLogprobs]:
        """For each chunk whose request asks: the logprobs of the prompt tokens its rows predict
        (row p predicts position p + 1) and the request does not hold yet, from the raw logits,
        PROMPT_LOGPROBS_ROWS rows at a time."""
        found = {}
        for chunk, first_row in zip(chunks, query_starts):
            request = request_of(chunk.request_id)
            count = request.sampling_params.prompt_logprobs
            if count is None:
                continue
            # Rows before `start` predict positions already held (position 0 is always held).
            start = max(chunk.start_position, held(chunk.request_id) - 1)
            stop = min(chunk.start_position + len(chunk.token_ids), request.num_prompt_tokens - 1)
            if stop <= start:
                continue
            targets = request.prompt_token_ids[start + 1:stop + 1]
            first_row += start - chunk.start_position
            entries = []
            for offset in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                piece = targets[offset:offset + PROMPT_LOGPROBS_ROWS]
                rows = hidden[first_row + offset:first_row + offset + len(piece)]
                entries += token_logprobs(self.model.compute_logits(rows), piece, [count] * len(piece))
            found[chunk.request_id] = PromptLogprobs(start + 1, tuple(entries))
        return found
