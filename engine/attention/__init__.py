"""Paged attention: per-step metadata, the torch reference and the backend choice."""
