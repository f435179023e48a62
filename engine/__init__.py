"""Continuous-batching engine over a paged KV cache, the attention backends and the HTTP server."""
