"""Our own Llama-family forward over the paged KV cache, and its weight loader."""
