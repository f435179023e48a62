"""Triton kernels of the attention backend: paged attention and the KV-cache write.

Importing this package imports nothing heavy; import the kernel modules themselves
(`engine.kernels.paged_attention`, `engine.kernels.write_kv`). Under the CPU interpreter,
TRITON_INTERPRET=1 must be set before those modules are first imported (Triton decides at
`@triton.jit` time whether a kernel is compiled or interpreted).
"""
