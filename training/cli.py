"""The `lengthwise` command line.

Each subcommand lives in its owning module, which provides `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their command runs, so `--help` is fast and
a command never pays for another's imports (torch, mlflow, lightgbm).

Bad input ends in one line, `lengthwise <command>: error: <message>`, and exit status 2, the shape
of argparse's usage errors: a value that can be checked alone is checked by its argparse type; what
can only fail once the command runs (a path that is no model, a KV cache too small for the model,
a file that is not JSON) raises ValueError or OSError, which `main` turns into that line.
LENGTHWISE_TRACEBACK=1 shows the traceback instead, for a ValueError that is a bug, not bad input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

# command path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("engine.server.serve_cli", "run the OpenAI-compatible HTTP server"),
    ("generate",): ("engine.generate_cli", "generate completions offline for a few prompts"),
    ("bench", "engine"): ("training.bench_engine", "engine vs HF static and continuous batching"),
    ("bench", "serve"): ("training.bench_serve", "load-test a running server"),
    ("bench", "attention"): ("training.bench_attention", "paged attention kernel vs SDPA (GPU)"),
    ("data", "prepare"): ("training.data_prepare", "build the ShareGPT turn table and data card"),
    ("train",): ("training.train", "train a length predictor, tracked in MLflow"),
    ("eval-predictor",): ("training.evaluate", "evaluate a predictor on the test split"),
    ("trace",): ("training.trace", "record the served model's output lengths"),
    ("simulate",): ("training.simulate", "discrete-event simulation of scheduling policies"),
}
# command path -> "module:function" that rewrites the parsed arguments before the command runs:
# the server takes a predictor folder, and the registry that names the champion is training's.
ARGUMENT_RESOLVERS: dict[tuple[str, ...], str] = {
    ("serve",): "training.serve_predictor:resolve_args",
}
# Engine and scheduler config fields an error may name, and the flag that sets each, in the
# commands that run the engine here: the config classes speak their own field names
# ("kv_cache_memory_gib 0.0001 holds no KV block"), which a command line user never typed. (In
# `bench serve` such a name is the remote server's, and stays.)
FIELD_FLAGS = {"kv_cache_memory_gib": "--kv-cache-memory", "max_num_batched_tokens": "--max-num-batched-tokens",
               "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
               "swap_space_gib": "--swap-space"}
ENGINE_COMMANDS = {("serve",), ("generate",), ("bench", "engine")}



def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lengthwise", description=__doc__.splitlines()[0])
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {(): parser.add_subparsers(dest="command", required=True)}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for path, (module, help_text) in COMMANDS.items():
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in groups:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                groups[prefix] = sub.add_subparsers(dest=f"command_{depth}", required=True)
        command_parser = groups[path[:-1]].add_parser(path[-1], help=help_text)
        command_parser.set_defaults(_module=module, _command=" ".join(path))
        parsers[path] = command_parser
    # argparse names a missing required subcommand by its metavar, else by its dest ("command_1").
    for group in groups.values():
        group.metavar = "{" + ",".join(group.choices) + "}"
    # Only the chosen command's module is imported to add its arguments.
    for path, command_parser in parsers.items():
        if list(path) == argv[: len(path)]:
            importlib.import_module(COMMANDS[path][0]).add_arguments(command_parser)
    parser.command_parsers = parsers  # main() reports stray arguments with the command's own usage
    return parser


def _check_store(args: argparse.Namespace) -> None:
    """`train` and `eval-predictor` name an MLflow store with --store; train would otherwise find a
    file in its place, an unwritable folder or a database that is no store, only when it logs,
    after the training (its default store too). eval-predictor only reads it."""
    if not hasattr(args, "store"):
        return
    from training.tracking import check_store, default_store

    if args._command == "train":
        check_store(args.store or default_store(), flag="--store" if args.store else "the MLflow store")
    elif args.store is not None:
        check_store(args.store, for_writing=False, flag="--store")


def _in_flag_terms(message: str, command_parser: argparse.ArgumentParser) -> str:
    """`message` with each config field in it named by the command's flag for it, where it has one."""
    flags = {option for action in command_parser._actions for option in action.option_strings}
    fields = {field: flag for field, flag in FIELD_FLAGS.items() if flag in flags}
    if not fields:
        return message
    return re.sub(r"(?<![\w-])(" + "|".join(fields) + r")(?![\w-])", lambda match: fields[match.group(1)], message)


def _resolve_arguments(args: argparse.Namespace) -> None:
    resolver = ARGUMENT_RESOLVERS.get(tuple(args._command.split()))
    if resolver is not None:
        module_name, function = resolver.split(":")
        getattr(importlib.import_module(module_name), function)(args)


def main(argv: list[str] | None = None) -> int:
    # Nothing may come from the hub at run time (weights and data are local): set before any
    # Hugging Face library is imported, unless the caller chose otherwise.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(argv)
    args, stray = parser.parse_known_args(argv)
    if stray:  # with the command's usage and name ("lengthwise serve: error: ..."), not the root's
        parser.command_parsers[tuple(args._command.split())].error(f"unrecognized arguments: {' '.join(stray)}")
    module = importlib.import_module(args._module)
    try:
        _check_store(args)
        _resolve_arguments(args)
        return int(module.run(args) or 0)
    except (ValueError, OSError) as exc:  # bad input found while running: one line, not a traceback
        if os.environ.get("LENGTHWISE_TRACEBACK") == "1":
            raise
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        command = tuple(args._command.split())
        if command in ENGINE_COMMANDS:
            message = _in_flag_terms(message, parser.command_parsers[command])
        # The same exceptions also come from bugs (list.remove, max of nothing): the hint says how
        # to see where one was raised.
        print(f"lengthwise {args._command}: error: {message or type(exc).__name__} "
              f"(LENGTHWISE_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
