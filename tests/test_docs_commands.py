"""The commands the docs print still parse: every `lengthwise ...` written inline in the README,
the measurements and the data cards, and every flag of the README's CLI synopsis. A renamed or
removed flag fails here, not in a reader's shell.

Only argument parsing runs (no model, data or server). Placeholders in capitals (N, PATH, DIR)
become sample values; `a|b` and `{a,b}` take their first choice; `[...]` keeps what it holds.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from training.cli import COMMANDS, _build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "data/MEASUREMENTS.md", "data/README.md", "data/predictors/README.md")
PLACEHOLDERS = {"N": "2", "S": "10", "B": "8", "K": "4", "MS": "100", "CV": "2", "GIB": "1", "T": "out/t.parquet",
                "L": "out/l.jsonl", "PATH": "out/path", "DIR": "out/dir", "FILE": "out/file.json",
                "POLICY": "fcfs", "KEY": "secret", "URL": "http://127.0.0.1:8000", "R": "1",
                "PARQUET": "out/resample.parquet", "RUN.json": "out/run.json"}


def _value(token: str) -> str:
    token = token.strip("[]")
    if token in PLACEHOLDERS:
        return PLACEHOLDERS[token]
    if token.startswith("{") and token.endswith("}"):
        return token[1:-1].split(",")[0]
    if "|" in token and "://" not in token:
        return _value(token.split("|")[0])
    return token


def _argv(command: str) -> list[str]:
    """The arguments after `lengthwise`, placeholders filled in; `...` (more of the same) dropped."""
    return [_value(token) for token in shlex.split(command)[1:] if token.strip("[]") != "..."]


def _inline_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = re.sub(r"\s*\n\s*", " ", (ROOT / doc).read_text())  # a command may wrap across lines
        found += [(doc, command) for command in sorted(set(re.findall(r"`(lengthwise [^`]*)`", text)))]
    return found


def _parse(argv: list[str]) -> str:
    """'' when argv parses as `lengthwise` would parse it, else argparse's message."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            _build_parser(argv).parse_args(argv)
    except SystemExit:
        return errors.getvalue().strip() or "exit"
    return ""


@pytest.mark.parametrize("doc, command", _inline_commands())
def test_an_inline_command_parses(doc: str, command: str) -> None:
    argv = _argv(command)
    assert _parse(argv) == "", f"{doc}: {command}"
    # argparse takes a prefix of a flag, so a renamed --sweep-loads would still parse --sweep-load.
    assert _flags(" ".join(argv)) <= _options_of(_command_path(command)), f"{doc}: {command}"


def test_the_docs_hold_inline_commands() -> None:
    assert len(_inline_commands()) >= 30  # the pattern still finds them


def _synopsis() -> list[str]:
    """The README's CLI block as entries: a command line with its indented continuation lines."""
    block = (ROOT / "README.md").read_text().split("## CLI", 1)[1].split("```", 2)[1]
    entries: list[str] = []
    for line in block.splitlines()[1:]:
        if line.startswith((" ", "\t")) and entries:
            entries[-1] += " " + line.strip()
        elif line.strip():
            entries.append(line.strip())
    return entries


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def _command_path(entry: str) -> tuple[str, ...]:
    words = entry.split()[1:]
    path = ()
    for word in words:
        if (*path, word) not in COMMANDS and not any(key[: len(path) + 1] == (*path, word) for key in COMMANDS):
            break
        path = (*path, word)
    return path


def _options_of(path: tuple[str, ...]) -> set[str]:
    argv = list(path)
    parser = _build_parser(argv)
    for name in path:  # walk down the subcommand parsers
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return {option for action in parser._actions for option in action.option_strings}


def test_every_lengthwise_flag_in_the_synopsis_exists() -> None:
    entries = [entry for entry in _synopsis() if entry.startswith("lengthwise ")]
    assert len(entries) >= 10
    for entry in entries:
        path = _command_path(entry)
        assert path in COMMANDS, entry
        missing = _flags(entry) - _options_of(path)
        assert not missing, f"{' '.join(path)}: {sorted(missing)} in the README's synopsis"


def _script_flags(script: str) -> set[str]:
    help_text = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               cwd=ROOT, timeout=120).stdout
    return _flags(help_text)


def _script_mentions() -> dict[str, set[str]]:
    """Script -> the flags the docs give it (before a `--`: what follows is bench serve's)."""
    mentions: dict[str, set[str]] = {}
    texts = [entry for entry in _synopsis() if entry.startswith("python scripts/")]
    for doc in DOCS:
        flat = re.sub(r"\s*\n\s*", " ", (ROOT / doc).read_text())
        texts += re.findall(r"`(?:[A-Z_]+=\S+ )?(python scripts/[^`]*)`", flat)
    for text in texts:
        script = text.split()[1]
        own = text.split(" -- ", 1)[0].split(" ")[2:]
        mentions.setdefault(script, set()).update(_flags(" ".join(own)))
    return mentions


def test_every_script_flag_in_the_docs_exists() -> None:
    mentions = _script_mentions()
    assert len(mentions) >= 8
    for script, flags in mentions.items():
        if script.endswith("serve_step_log.py"):
            continue  # takes `serve`'s flags, checked above; --help needs STEP_LOG set
        missing = flags - _script_flags(script)
        assert not missing, f"{script}: {sorted(missing)} in the docs"


def test_the_checks_catch_a_renamed_flag() -> None:
    assert "unrecognized arguments: --num-promptz" in _parse(["simulate", "--num-promptz", "3"])
    assert "--num-promptz" not in _options_of(("simulate",)) and "--num-requests" in _options_of(("simulate",))
