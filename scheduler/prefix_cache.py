"""Automatic prefix caching: full KV blocks found again by the tokens they hold.

A full block of a sequence is named by its key: (the previous block's chain hash, its own tokens),
so two sequences share a block exactly when they agree on every token up to its end (the tokens
are compared, not only hashed; a chain hash stands for the blocks before). The chain hash is a
SHA-256 digest of the previous one and the block's tokens, not Python's `hash()`: that one is
64-bit and unsalted for ints and tuples, so a client could search offline for two prefixes that
collide and be served KV computed for another client's context (vLLM's CVE-2025-25183). A
request's chain hashes are computed once and kept on it (`Request.block_hashes`), extended as its
tokens grow.

A block is registered when a step is granted the tokens that fill it (`register`, from the block
manager's allocation), so a request admitted later in the same step finds it too: the `n`
choices of one prompt, admitted together, share its blocks. Its KV is not written yet, but it is
by the time that request reads it: every layer writes the whole batch's K/V before any of it
attends, and the request's own tokens go to blocks of its own. Such a registration holds once
the step has run (`commit`); should the step fail, it is dropped (`discard_uncommitted`), with
its half-written KV. A registered block stays findable after its holders
free it, while it waits on the free list, until it is allocated for other tokens (`forget`), so
a free list ordered by release time evicts the least recently used first. A request is served
at most (num_tokens - 1) // block_size blocks from the cache: at least one token is fed, whose
logits give the next token, and it goes into a block of the request's own.

A request that asks for prompt logprobs finds nothing: they need every prompt position's
hidden state. A request with a cache salt (vLLM's `cache_salt`) starts its chain from the salt's
digest, so it shares blocks only with requests of the same salt.
"""

from __future__ import annotations

import hashlib
import struct

from scheduler.request import Request
from scheduler.step import token_slice

BlockKey = tuple[bytes | None, tuple[int, ...]]


def chain_hash(previous: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The digest naming a block whose tokens are `tokens`, after the blocks `previous` names."""
    digest = hashlib.sha256(previous or b"")
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


def salt_digest(request: Request) -> bytes | None:
    """What a request's first block follows: its cache salt's digest, or nothing."""
    salt = request.sampling_params.cache_salt
    return None if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode()).digest()


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._registered: dict[str, int] = {}  # request id -> blocks of its table looked at
        self._uncommitted: list[int] = []  # registered in the step not yet run
        self.num_query_tokens = 0  # prompt tokens of requests looked up on admission
        self.num_hit_tokens = 0  # of those, served from the cache
        # A request looked up again (resumed after preemption by recompute, or after a failed
        # step) is counted apart, as vLLM counts a preempted one: finding its own blocks again
        # would inflate the hit rate that the two above report.
        self.num_requery_tokens = 0
        self.num_requery_hit_tokens = 0
        self.num_evictions = 0  # registered blocks allocated for other tokens, ever

    def _key(self, request: Request, index: int) -> BlockKey:
        """Block `index`'s key, extending the request's chain hashes as far as needed."""
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) <= index:
            at = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else salt_digest(request),
                                     token_slice(request, at * size, (at + 1) * size)))
        return (hashes[index - 1] if index else salt_digest(request),
                token_slice(request, index * size, (index + 1) * size))

    def lookup(self, request: Request) -> list[int]:
        """The device blocks holding the request's longest cached prefix, in order."""
        if request.sampling_params.prompt_logprobs is not None:
            return []
        blocks = []
        for index in range((request.num_tokens - 1) // self.block_size):
            block = self._block_of.get(self._key(request, index))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, request: Request, num_hit_tokens: int, again: bool) -> None:
        if request.sampling_params.prompt_logprobs is not None:
            return  # it skips the cache, and vLLM counts no query for it (it read as a miss)
        if again:
            self.num_requery_tokens += request.num_tokens
            self.num_requery_hit_tokens += num_hit_tokens
        else:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens

    def register(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Register the blocks of the request's table that its first `num_tokens` fill, if not
        registered yet (uncommitted until the step has run). A block whose tokens another block
        already holds stays unregistered (two requests computed them at once)."""
        start = self._registered.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(table))
        for index in range(start, num_full):
            key = self._key(request, index)
            block = table[index]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
                self._uncommitted.append(block)
        self._registered[request.request_id] = max(start, num_full)

    def commit(self) -> None:
        """The step ran: the KV of the blocks registered for it is written."""
        self._uncommitted.clear()

    def discard_uncommitted(self) -> None:
        """The step failed: its blocks may hold half-written KV, so nothing finds them. (Their
        holders start over by recompute, and register them again.)"""
        for block in self._uncommitted:
            self.forget(block)
        self._uncommitted.clear()

    def forget(self, block: int) -> None:
        """The block is allocated for other tokens: it no longer holds its key's."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self.num_evictions += 1

    def drop_request(self, request_id: str) -> None:
        """The request's table is gone (freed, or swapped out to come back in other blocks)."""
        self._registered.pop(request_id, None)

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def check(self) -> None:
        if len(self._block_of) != len(self._key_of):
            raise AssertionError("prefix cache: a block is registered under two keys")
        for key, block in self._block_of.items():
            if self._key_of.get(block) != key:
                raise AssertionError(f"prefix cache: block {block} is not registered under its key")

