"""A stand-in model runner that exercises the scheduler's contract without tensors.

`PagedTokenRunner` keeps a "KV cache" of token ids in paged slots (slot = block * block_size +
offset), written through each chunk's block table, copied on swap-out and swap-in, and reads a
sequence back through the table to sample. Its next token is a deterministic function of the whole
context it reads, so a request's output matches a never-preempted run only if every block table,
start position, chunk and swap copy the scheduler produced was right. Tests and examples use it.
"""

from __future__ import annotations

from scheduler.output import ModelRunnerOutput, SchedulerOutput

VOCAB = 997


def next_token(context: list[int]) -> int:
    """Deterministic 'model': a position-weighted hash of the context."""
    acc = len(context)
    for position, token in enumerate(context):
        acc = (acc * 31 + (position + 1) * (token + 7)) % 1_000_003
    return acc % VOCAB


class PagedTokenRunner:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device: list[int | None] = [None] * (num_gpu_blocks * block_size)
        self.host: list[int | None] = [None] * (num_cpu_blocks * block_size)

    def _copy_block(self, src: list, src_block: int, dst: list, dst_block: int) -> None:
        size = self.block_size
        dst[dst_block * size:(dst_block + 1) * size] = src[src_block * size:(src_block + 1) * size]

    def _slot(self, block_ids: tuple[int, ...], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for device_block, host_block in output.swap_out:
            self._copy_block(self.device, device_block, self.host, host_block)
        for host_block, device_block in output.swap_in:
            self._copy_block(self.host, host_block, self.device, device_block)
        # Every chunk's tokens are written before any context is read, as a model layer writes
        # the whole batch's K/V before it attends: a request may read a block another request's
        # chunk fills in the same step (prefix caching).
        for chunk in output.chunks:
            for offset, token in enumerate(chunk.token_ids):
                self.device[self._slot(chunk.block_ids, chunk.start_position + offset)] = token
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            if chunk.sample:
                end = chunk.start_position + len(chunk.token_ids)
                context = [self.device[self._slot(chunk.block_ids, p)] for p in range(end)]
                if any(token is None for token in context):
                    raise AssertionError(f"{chunk.request_id}: unwritten KV slot in its context")
                sampled[chunk.request_id] = next_token(context)  # type: ignore[arg-type]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What a request produces with ignore_eos when nothing goes wrong."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]
