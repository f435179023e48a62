"""argparse types that refuse impossible numbers with a one-line usage error (every command's), the
check of an output path a command makes before its work, so a bad one fails in seconds, not
after the run whose results it was to hold, and the server command's log format."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path
from typing import Callable

from scheduler.policies import POLICIES
from scheduler.request import SEED_MAX, SEED_MIN


def configure_serve_logging(level: str) -> None:
    """`lengthwise serve`'s log lines (timestamped), from its first step on: the predictor's
    resolution (training/serve_predictor.py) logs before the server starts."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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


def policy_list(text: str) -> list[str]:
    """Comma-separated scheduling policies: at least one, each known."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no policies: name one or more of {','.join(POLICIES)}")
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policies {','.join(unknown)}; choose from {','.join(POLICIES)}")
    return names


def port_number(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in 0-65535, got {text}")
    return port


def cors_origin(text: str) -> str:
    """An origin as browsers send it (scheme://host[:port], no trailing slash, which would never
    match), or "*" for any."""
    origin = text.rstrip("/")
    if origin != "*" and "://" not in origin:
        raise argparse.ArgumentTypeError(f"an origin is scheme://host[:port] or '*', got {text!r}")
    return origin


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


def top_p(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:  # refuses nan too
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {text}")
    return value


def tier_weights(text: str) -> list[float]:
    """Weights of the interactive, standard and batch tiers: three numbers >= 0, not all zero."""
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise argparse.ArgumentTypeError(
            f"takes three weights >= 0, not all zero, for interactive,standard,batch (e.g. 0,1,0), got {text!r}")
    return weights


def checked_by(parse: Callable[[str], object], name: str) -> Callable[[str], str]:
    """An argparse type that keeps the text but refuses it when `parse(text)` raises ValueError,
    with that error's message (argparse would print only "invalid value")."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    check.__name__ = name
    return check


def prepare_output_file(path: Path, flag: str) -> Path:
    """Create the folder of the output file `path` and check that the file can be written there;
    OSError naming `flag` otherwise (a folder in its place, a folder that cannot be made)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path}: is a folder, not a file")
    _make_folder(path.parent, flag)
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{flag} {path}: not writable")
    return path


def prepare_output_dir(path: Path, flag: str) -> Path:
    """Create the output folder `path` and check that files can be written in it."""
    path = Path(path)
    _make_folder(path, flag)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"{flag} {path}: not writable")
    return path


def _make_folder(folder: Path, flag: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only or virtual file system (/proc)
        raise OSError(f"{flag}: cannot create the folder {folder} ({exc.strerror or exc})") from None
