"""Continuous-batching engine over a paged KV cache, the attention backends and the HTTP server.

`from engine import LLM, SamplingParams` reads as vLLM's `from vllm import LLM, SamplingParams`.
They are imported on first use, so importing a light module of this package does not load torch.
"""

from __future__ import annotations

from typing import Any

_LAZY_EXPORTS = {"LLM": ("engine.llm", "LLM"), "SamplingParams": ("scheduler.request", "SamplingParams")}
__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY_EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)
