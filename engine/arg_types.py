"""argparse types that refuse impossible numbers with a one-line usage error (every command's)."""

from __future__ import annotations

import argparse
import math

from scheduler.request import SEED_MAX, SEED_MIN


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):  # refuses nan and inf too
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_rate(text: str) -> float:
    """A positive number, or inf (everything at once)."""
    value = float(text)
    if not value > 0:  # refuses nan too
        raise argparse.ArgumentTypeError(f"must be a positive number or inf, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def positive_float_list(text: str) -> list[float]:
    """Comma-separated positive numbers; empty text is an empty list."""
    return [positive_float(part) for part in text.split(",") if part.strip()]


def port_number(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in 0-65535, got {text}")
    return port


def sampling_seed(text: str) -> int:
    """A request's sampling seed: any 64-bit integer, as the HTTP API takes."""
    value = int(text)
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {text}")
    return value


def top_k(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, or -1 (disabled), got {text}")
    return value
