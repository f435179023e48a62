"""argparse types that refuse impossible numbers with a one-line usage error (every command's), the
check of an output path a command makes before its work, so a bad one fails in seconds, not
after the run whose results it was to hold, and the server command's log format."""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from scheduler.policies import POLICIES
from scheduler.request import SEED_MAX, SEED_MIN

Number = TypeVar("Number", int, float)


def configure_serve_logging(level: str) -> None:
    """`lengthwise serve`'s log lines (timestamped), from its first step on: the predictor's
    resolution (training/serve_predictor.py) logs before the server starts."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def bounded(name: str, convert: Callable[[str], Number], accepts: Callable[[Number], bool],
            requirement: str) -> Callable[[str], Number]:
    """An argparse type named `name` (argparse's "invalid NAME value" when `convert` fails): the
    converted text, refused with "REQUIREMENT, got TEXT" unless `accepts` it. Each `accepts` below
    is a comparison that nan fails, so nan is refused too."""

    def parse(text: str) -> Number:
        value = convert(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text}")
        return value

    parse.__name__ = name
    return parse


positive_int = bounded("positive_int", int, lambda v: v > 0, "must be a positive integer")
non_negative_int = bounded("non_negative_int", int, lambda v: v >= 0, "must be zero or more")
# A number of examples to rank: Kendall's tau needs at least two (one was a NaN, logged).
ranked_rows = bounded("ranked_rows", int, lambda v: v >= 2, "a Kendall's tau needs at least 2 rows")
port_number = bounded("port_number", int, lambda v: 0 <= v <= 65535, "a TCP port lies in 0-65535")
# A request's sampling seed: any 64-bit integer, as the HTTP API takes.
sampling_seed = bounded("sampling_seed", int, lambda v: SEED_MIN <= v <= SEED_MAX,
                        f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
top_k = bounded("top_k", int, lambda v: v >= -1, "must be an integer >= 0, or -1 (disabled)")
positive_float = bounded("positive_float", float, lambda v: math.isfinite(v) and v > 0, "must be a positive number")
# A positive number, or inf (everything at once).
positive_rate = bounded("positive_rate", float, lambda v: v > 0, "must be a positive number or inf")
non_negative_float = bounded("non_negative_float", float, lambda v: math.isfinite(v) and v >= 0,
                             "must be zero or more")
top_p = bounded("top_p", float, lambda v: 0 < v <= 1, "must be a number in (0, 1]")
share_of_one = bounded("share_of_one", float, lambda v: 0.0 <= v <= 1.0, "must be between 0 and 1")
share_above_zero = bounded("share_above_zero", float, lambda v: 0.0 < v <= 1.0, "must be above 0 and at most 1")


def cpu_threads(text: str) -> int:
    """A torch thread count no larger than the CPUs this process may run on: more only contend for
    them, and tens of thousands ended in a segmentation fault (libgomp could not start them)."""
    value = positive_int(text)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if value > cpus:
        raise argparse.ArgumentTypeError(f"this machine gives {cpus} CPUs to the process, got {text} threads")
    return value


def positive_float_list(text: str) -> list[float]:
    """Comma-separated positive numbers; empty text is an empty list."""
    try:
        return [positive_float(part) for part in text.split(",") if part.strip()]
    except (ValueError, argparse.ArgumentTypeError):  # argparse named the type: "invalid positive_float_list"
        raise argparse.ArgumentTypeError(f"must be comma-separated positive numbers, got {text}") from None


def policy_list(text: str) -> list[str]:
    """Comma-separated scheduling policies: at least one, each known."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no policies: name one or more of {','.join(POLICIES)}")
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policies {','.join(unknown)}; choose from {','.join(POLICIES)}")
    return names


def cors_origin(text: str) -> str:
    """An origin as browsers send it (scheme://host[:port], no trailing slash, which would never
    match), or "*" for any."""
    origin = text.rstrip("/")
    if origin != "*" and "://" not in origin:
        raise argparse.ArgumentTypeError(f"an origin is scheme://host[:port] or '*', got {text!r}")
    return origin


def api_key(text: str) -> str:
    """An API key: an empty one would be sent as no key by clients and match no request."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an API key must not be empty")
    return text


# Where `serve` and `bench serve` read the API key when --api-key is not given, first found first:
# a key on the command line is visible to every local user (ps), and vLLM deployments set
# VLLM_API_KEY.
API_KEY_VARIABLES = ("LENGTHWISE_API_KEY", "VLLM_API_KEY")


def api_key_or_environment(given: str | None) -> str | None:
    """`given` (--api-key), else the first of API_KEY_VARIABLES that is set, else None; a variable
    set but empty is an error, not a server open to all."""
    import os

    if given is not None:
        return given
    for variable in API_KEY_VARIABLES:
        key = os.environ.get(variable)
        if key is not None:
            if not key.strip():
                raise ValueError(f"${variable} is set but empty: unset it, or give the key")
            return key
    return None


# A file name's bytes on Linux file systems (NAME_MAX); a stem leaves room for its suffix.
MAX_FILE_NAME_BYTES = 255
STEM_SUFFIX_ROOM = 16


def file_stem(text: str) -> str:
    """A name that becomes a file name in an output folder (a run's label): no folders in it, and
    short enough for a file name with its suffix (bench serve wrote its files only after the load)."""
    if not text.strip() or "/" in text or "\\" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"a run name becomes a file name: no '/', got {text!r}")
    size = len(text.encode("utf-8", "surrogateescape"))  # argv's undecodable bytes come as surrogates
    if size > MAX_FILE_NAME_BYTES - STEM_SUFFIX_ROOM:
        raise argparse.ArgumentTypeError(f"a run name becomes a file name: at most "
                                         f"{MAX_FILE_NAME_BYTES - STEM_SUFFIX_ROOM} bytes, got {size}")
    return text


def named_path(text: str) -> Path:
    """A path given in words: empty text (an unset shell variable) would mean the working folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a path: an empty one would mean the working folder")
    return Path(text)


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
    """Check that the output file `path` can be written (`check_output_location`), then create its
    folder, so a bad path fails before the work whose results it was to hold. Call it after the
    command's other checks: a folder it made stays behind if a later one fails."""
    path = Path(path)
    check_output_location(path, flag, folder=False)
    _make_folder(path.parent, flag)
    return path


def prepare_output_file_or_exit(parser: argparse.ArgumentParser, path: Path | None, flag: str) -> None:
    """prepare_output_file for an optional output flag of a script, before its long work: a path
    that cannot be written ends the command as a usage error (one line, exit 2)."""
    if path is not None:
        try:
            prepare_output_file(path, flag)
        except OSError as exc:
            parser.error(str(exc))


def prepare_output_dir(path: Path, flag: str) -> Path:
    """Check that files can be written in the output folder `path`, then create it."""
    path = Path(path)
    check_output_location(path, flag, folder=True)
    _make_folder(path, flag)
    return path


def check_output_location(path: Path, flag: str, folder: bool) -> None:
    """OSError naming `flag` unless `path` (a file, or a folder when `folder`) could be written,
    creating nothing: nothing of the wrong kind in its place, and the nearest folder that exists
    takes a new file. That is tried, not read from permission bits, which root always passes
    (/proc takes no new file even from root)."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {path} is a file, not a folder")
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{flag} {path}: is a folder, not a file")
    if not folder and path.exists():
        _try_writing(lambda: open(path, "ab").close(), path, flag)
        return
    existing = path if folder and path.exists() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{flag} {path}: {existing} is a file, not a folder")
    _try_writing(lambda: tempfile.NamedTemporaryFile(dir=existing, prefix=".lengthwise-probe-").close(), path, flag)


def _try_writing(write: Callable[[], None], path: Path, flag: str) -> None:
    try:
        write()
    except OSError as exc:
        raise PermissionError(f"{flag} {path}: not writable ({exc.strerror or exc})") from None


def _make_folder(folder: Path, flag: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only or virtual file system (/proc)
        raise OSError(f"{flag}: cannot create the folder {folder} ({exc.strerror or exc})") from None
