"""Bad command-line input ends in one clear line on stderr and exit status 2, never a traceback,
and never after the work it would spoil (a model load, a simulation, a load test)."""

from __future__ import annotations

import pytest

from training.cli import main


def usage_error(capsys, argv: list[str]) -> str:
    """The message of an argparse usage error (exit status 2) for `argv`."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2, argv
    return capsys.readouterr().err


def test_a_missing_subcommand_is_named_by_its_choices(capsys) -> None:
    assert "required: {engine,serve,attention}" in usage_error(capsys, ["bench"])
    assert "required: {prepare}" in usage_error(capsys, ["data"])
