"""The OpenAI-compatible HTTP service: app factory, request/response models, errors, metrics, CLI.

Nothing in the project imports this package except the `lengthwise serve` entry point.
"""
