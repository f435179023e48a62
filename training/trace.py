"""`lengthwise trace`: record the served model's own output lengths on ShareGPT prompts.

Algorithm. Candidate prompts are the turn table's prompts that fit the context with room for
`max_tokens` of output, deduplicated by text, in a seeded random order (so any prefix is a
random sample across splits, and each row keeps its turn-table split). They run through the
offline engine (`engine.llm.LLM`), fed continuously, with the served defaults (temperature 1.0, top_p
1.0) and a per-prompt seed, so a rerun draws each prompt from the same seeds (mostly the same
length, though a draw can flip on the last bits of a batch-dependent logit; engine/sampler.py).
(Rows logged before session 6 drew from per-request generator streams, which the stateless
sampler replaced.) Each finished prompt is appended to a JSONL log at once, with its sampling
settings: an interrupted run resumes by skipping the keys already logged, and refuses a log
sampled with other settings or drawn under another prompt budget. The log is then written as a
parquet table, settings included, that `lengthwise train --labels trace` learns from; a table
written before session 20 holds none, and its rows are taken to have the committed trace's
settings (LEGACY_TABLE_SETTINGS); one written in sessions 20-31 holds all but the prompt budget,
which is then unknown. The `output_tokens` counts every generated token, a `stop` row's
end-of-sequence token included: it costs a decode step like any other (ShareGPT's labels count
the reply without its end-of-turn token, one less). The log is git-ignored and the table
committed, so a run first copies into the log any table row it lacks: a fresh clone extends the
committed trace instead of starting over (or overwriting it with fewer rows).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.arg_types import non_negative_float, non_negative_int, positive_int, prepare_output_file
from training import dataset

DEFAULT_TRACE = dataset.REPO_ROOT / "data" / "traces" / "smollm2_sharegpt.parquet"
DEFAULT_LOG = dataset.REPO_ROOT / "data" / "traces" / "smollm2_sharegpt.jsonl"
# A second sample of the trace's test prompts (`--resample-split test --seed 1`): how much of a
# traced length is chance, and a second label for `eval-predictor --labels trace`.
DEFAULT_RESAMPLE = dataset.REPO_ROOT / "data" / "traces" / "smollm2_sharegpt_test_resample.parquet"
TRACE_COLUMNS = ("key", "conversation_id", "turn_index", "prompt", "prompt_tokens", "output_tokens",
                 "finish_reason", "split", "in_train")
# Null where a row's setting is unknown. `max_prompt_tokens` is the prompt budget the candidates
# were drawn under (the flag, or less where the context less --max-tokens is less): another budget
# orders other candidates, so a resumed trace would no longer be one random sample.
SETTING_COLUMNS = ("max_tokens", "temperature", "seed", "max_prompt_tokens")
# What every table written before the settings were columns was sampled with: the defaults below.
# Their seeds are unknown (rows before session 6 drew from generator streams), except that the
# committed trace's later rows used --seed 0, which a resample must therefore not reuse.
# The prompt budget is the committed trace's (tests/test_training_mutants.py checks its order); a table
# of one's own drawn before the trace defaults were the committed trace's (436ed20, 2026-11-29) had
# the context less --max-tokens, and would be refused a resume at its real budget.
LEGACY_TABLE_SETTINGS = {"max_tokens": 256, "temperature": 1.0, "seed": None, "max_prompt_tokens": 384}
LEGACY_TRACE_SEED = 0


def prompt_key(prompt: str) -> str:
    return hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).hexdigest()


def candidate_rows(max_prompt_tokens: int, seed: int) -> list[dict]:
    """Turn-table rows that fit the context, one per distinct prompt, in a seeded random order."""
    turns = dataset.load_turns().select_columns(
        ["conversation_id", "turn_index", "prompt", "prompt_tokens", "split", "in_train"])
    fits = np.flatnonzero(np.asarray(turns["prompt_tokens"]) <= max_prompt_tokens)
    order = fits[np.random.default_rng(seed).permutation(len(fits))]
    rows, seen = [], set()
    for index in order.tolist():
        row = turns[index]
        key = prompt_key(row["prompt"])
        if key not in seen:
            seen.add(key)
            rows.append({"key": key, **row})
    return rows


# What resuming and the table read: every column (a record of three fields passed, ran the whole
# trace, and failed writing the table, as did every run after it).
LOG_RECORD_FIELDS = TRACE_COLUMNS


@dataclass(frozen=True)
class LogContents:
    records: list[dict]
    # 1-based numbers of unreadable lines before the last: not an interrupted write (the next
    # append trims that one), so a damaged file, whose prompts are traced again.
    damaged_lines: list[int]


def read_log(log_path: Path) -> list[dict]:
    """The log's records (`read_log_contents`)."""
    return read_log_contents(log_path).records


def read_log_contents(log_path: Path) -> LogContents:
    """The log's records, and which lines were unreadable. ValueError, before anything is appended,
    for a file that is no trace log: another file given as --log lost its last line to
    `trim_partial_line` and took JSON lines, and JSON lines of other records were a KeyError
    traceback after the model had loaded."""
    if not log_path.exists():
        return LogContents([], [])
    try:
        text = log_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--log {log_path}: not a trace log (not UTF-8 text)") from None
    records, unparsed = [], []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            unparsed.append(number)  # a last line an interrupted write cut off, or damage; the rest are good
            continue
        if not (isinstance(record, dict) and all(name in record for name in LOG_RECORD_FIELDS)):
            raise ValueError(f"--log {log_path}: line {number} is no trace record (one has "
                             f"{', '.join(LOG_RECORD_FIELDS)}): pass another --log")
        records.append(record)
    # Unparsed lines are cut-off writes only beside records, or alone as one unterminated last line.
    interrupted_last = bool(unparsed) and unparsed[-1] == len(lines) and not text.endswith("\n")
    if unparsed and not records and not (interrupted_last and len(unparsed) == 1):
        raise ValueError(f"--log {log_path}: not a trace log (no line is a JSON record): pass another --log")
    return LogContents(records, unparsed[:-1] if interrupted_last else unparsed)


def trim_partial_line(log_path: Path) -> None:
    """End the log on a line break before appending: a last line an interrupted write cut off is
    removed, and one written whole but for its line break (which read_log counts) is ended."""
    if not log_path.exists():
        return
    data = log_path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:])
    except ValueError:
        with log_path.open("r+b") as log:
            log.truncate(start)
        return
    with log_path.open("ab") as log:
        log.write(b"\n")


def records_not_logged(logged: list[dict], table_path: Path) -> list[dict]:
    """As log records, the rows of an existing trace table whose key the log's records lack."""
    if not table_path.exists():
        return []
    keys = {record["key"] for record in logged}
    return [table_record(row) for row in load_trace(path=table_path).to_list() if row["key"] not in keys]


def append_records(log_path: Path, records: list[dict]) -> None:
    if records:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        trim_partial_line(log_path)
        with log_path.open("a", encoding="utf-8") as log:
            log.writelines(json.dumps(record) + "\n" for record in records)


def seed_log_from_table(log_path: Path, table_path: Path) -> int:
    """Append to the log every row of an existing trace table whose key it lacks; returns how many."""
    missing = records_not_logged(read_log(log_path), table_path)
    append_records(log_path, missing)
    return len(missing)


def table_record(row: dict) -> dict:
    """A table row as a log record: its settings, or the legacy ones for a table without them."""
    # A table of settings columns may predate one of them (max_prompt_tokens): that one is unknown.
    settings = {name: row.get(name) for name in SETTING_COLUMNS} if "seed" in row else LEGACY_TABLE_SETTINGS
    return {**{name: row[name] for name in TRACE_COLUMNS},
            **{name: value for name, value in settings.items() if value is not None}}


def trace_seeds(path: Path = DEFAULT_TRACE) -> set[int]:
    """The --seed values a trace table's rows were drawn with (the legacy trace's for one without)."""
    import pyarrow.parquet as pq

    if not Path(path).exists():
        return set()
    if "seed" not in pq.read_schema(path).names:
        return {LEGACY_TRACE_SEED}
    return {seed for seed in pq.read_table(path, columns=["seed"])["seed"].to_pylist() if seed is not None}


def seed_of(key: str, seed: int) -> int:
    return (int(key, 16) + seed) % (2**31 - 1)


def check_resume_settings(records: list[dict], max_tokens: int, temperature: float, seed: int,
                          max_prompt_tokens: int | None = None) -> None:
    """ValueError unless a log's records were sampled as this run would: one trace mixing caps or
    temperatures would rank lengths of different distributions, and one mixing prompt budgets
    would sample prompts unevenly. Records carry their settings since session 12 (the prompt
    budget since session 32); an older record (or one copied from a table) shows its cap only
    when it stopped at it. A budget of None (a resample, whose prompts are the trace's) is not
    checked."""
    wanted = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    for record in records:
        if max_prompt_tokens is not None and record.get("max_prompt_tokens") not in (None, max_prompt_tokens):
            raise ValueError(f"the log holds prompts drawn from those of at most {record['max_prompt_tokens']} "
                             f"tokens, this run draws from those of at most {max_prompt_tokens} (--max-prompt-tokens, "
                             "within the context less --max-tokens): pass the log's budget, or another --log and --out")
        for name, value in wanted.items():
            if record.get(name) is not None and record[name] != value:
                raise ValueError(f"the log holds prompts sampled with {name} {record[name]}, this run asks "
                                 f"{value}: pass the log's settings, or another --log and --out")
        if "max_tokens" not in record and record["finish_reason"] == "length" and record["output_tokens"] != max_tokens:
            raise ValueError(f"the log holds prompts cut at {record['output_tokens']} tokens, this run asks "
                             f"--max-tokens {max_tokens}: pass the log's cap, or another --log and --out")


def record_trace(llm, rows: list[dict], log_path: Path, max_tokens: int, temperature: float,
                 window: int, seed: int, max_prompt_tokens: int | None = None) -> int:
    """Generate for `rows` not yet in the log, appending one JSON line per prompt; returns the count.

    Prompts are fed to the engine so that `window` are in flight at once and each finished one is
    logged at once: the batch never drains waiting for a group's longest reply, and an interrupt
    loses only the prompts still running.
    """
    from tqdm import tqdm

    from scheduler.request import SamplingParams

    logged = read_log(log_path)
    check_resume_settings(logged, max_tokens, temperature, seed, max_prompt_tokens)
    done = {record["key"] for record in logged}
    todo = [row for row in rows if row["key"] not in done]
    pending = iter(todo)
    in_flight: dict[str, dict] = {}
    engine = llm.engine

    def feed() -> None:
        for row in pending:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed_of(row["key"], seed))
            engine.add_request(f"trace-{row['key']}", row["prompt"], params)
            in_flight[f"trace-{row['key']}"] = row
            if len(in_flight) >= window:
                return

    log_path.parent.mkdir(parents=True, exist_ok=True)
    trim_partial_line(log_path)
    with log_path.open("a", encoding="utf-8") as log, tqdm(total=len(todo), desc="trace", unit="prompt") as bar:
        feed()
        while in_flight:
            for output in engine.step():
                if output.finished:
                    row = in_flight.pop(output.request_id)
                    record = {**row, "output_tokens": len(output.token_ids), "finish_reason": output.finish_reason,
                              "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                              "max_prompt_tokens": max_prompt_tokens}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    bar.update(1)
            feed()
    return len(todo)


def write_trace_table(log_path: Path, table_path: Path) -> int:
    """The log's rows as the table; its row count. A table that holds every logged row already is
    left as it is: rewritten, the committed (legacy-format) trace changed its bytes, not its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = read_log(log_path)
    if table_path.exists():
        held = set(pq.read_table(table_path, columns=["key"]).column("key").to_pylist())
        if {record["key"] for record in records} <= held:
            return len(held)
    columns = {name: [record[name] for record in records] for name in TRACE_COLUMNS}
    types = {"max_tokens": pa.int64(), "temperature": pa.float64(), "seed": pa.int64(), "max_prompt_tokens": pa.int64()}
    columns.update({name: pa.array([record.get(name) for record in records], types[name]) for name in SETTING_COLUMNS})
    table = pa.table(columns)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the table and renamed over it: an interrupt (Ctrl-C, a kill) mid-write would
    # leave the committed trace truncated, and every later run failing on it.
    partial = table_path.with_name(f".{table_path.name}.partial")
    pq.write_table(table, partial, compression="zstd", compression_level=19)
    os.replace(partial, table_path)
    return table.num_rows


def load_trace(split: str | None = None, path: Path = DEFAULT_TRACE):
    """The trace table (datasets.Dataset), optionally one split of it."""
    import datasets

    if not Path(path).exists():
        raise FileNotFoundError(f"trace table {path} missing; run `lengthwise trace`")
    table = datasets.load_dataset("parquet", data_files=str(path), split="train",
                                  cache_dir=dataset.hf_cache_dir([path]))
    return table if split is None else table.filter(lambda s: s == split, input_columns="split")


def lengths_by_key(path: Path) -> dict[str, int]:
    """A trace table's output length of each prompt, by prompt key."""
    return {row["key"]: row["output_tokens"] for row in load_trace(path=path).to_list()}


def check_trace_table(path: Path, flag: str, columns: tuple[str, ...] = ("key", "output_tokens")) -> None:
    """ValueError unless `path` is a parquet table with a trace's key and output lengths, and the
    other `columns` asked for (a table resumed from must hold every column a log record does)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{flag} {path}: not a parquet trace table ({exc})") from None
    schema = metadata.schema.to_arrow_schema()
    missing = sorted(set(columns) - set(schema.names))
    if missing:
        raise ValueError(f"{flag} {path}: not a trace table (no column {', '.join(missing)})")
    # Keys of another type matched no prompt (exit 0, a NaN tau), and an empty table was a
    # 47-line traceback from datasets.
    if not (pa.types.is_string(schema.field("key").type) or pa.types.is_large_string(schema.field("key").type)):
        raise ValueError(f"{flag} {path}: not a trace table (key is {schema.field('key').type}, not text)")
    if not pa.types.is_integer(schema.field("output_tokens").type):
        raise ValueError(f"{flag} {path}: not a trace table (output_tokens is {schema.field('output_tokens').type}, "
                         f"not integers)")
    if metadata.num_rows == 0:
        raise ValueError(f"{flag} {path}: the trace table holds no rows")


def trace_hash(path: Path = DEFAULT_TRACE) -> str:
    return dataset.files_hash([path])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int,
                        help="prompts in the trace, counting those --out and --log hold already (it "
                             "resumes; by default from the committed trace); required unless --agreement")
    parser.add_argument("--model", default=str(dataset.CONVERTED_MODEL_DIR))
    # Defaults are the committed trace's: at ~40 prompts a minute on this CPU, 2,000 prompts fit an
    # hour only with replies capped at 256 tokens (about half of SmolLM2's reach the cap).
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="output cap per prompt (default %(default)s)")
    parser.add_argument("--temperature", type=non_negative_float, default=1.0,
                        help="default %(default)s, the server's")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384,
                        help="only prompts this short (and always what fits the context with --max-tokens)")
    parser.add_argument("--window", type=positive_int, default=64,
                        help="prompts queued in the engine at once (above max_num_seqs keeps the batch full)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG,
                        help="append-only JSONL, the resume point (default: data/traces/smollm2_sharegpt.jsonl)")
    parser.add_argument("--out", type=Path, default=DEFAULT_TRACE,
                        help="parquet trace table, extended (default: the committed "
                             "data/traces/smollm2_sharegpt.parquet)")
    parser.add_argument("--resample-split", default=None, choices=("train", "validation", "test"),
                        help="instead: sample this split of the committed trace again (use another "
                             "--seed, --log and --out) and report how well two samples agree")
    parser.add_argument("--agreement", type=Path, default=None, metavar="PARQUET",
                        help="instead: only report the agreement of an earlier resample with the trace")


def trace_rows(split: str, path: Path = DEFAULT_TRACE) -> list[dict]:
    """The rows of one split of a trace table, without their output lengths."""
    table = load_trace(split, path)
    return [{name: row[name] for name in TRACE_COLUMNS if name not in ("output_tokens", "finish_reason")}
            for row in table.to_list()]


def sample_agreement(first: Path, second: Path) -> dict:
    """Kendall tau between two samples of the same prompts (how much of a length is chance), and
    the tau a perfect expected-length predictor would reach against one sample (training/label_noise.py)."""
    from scipy import stats

    from training.label_noise import ranking_ceiling

    a, b = lengths_by_key(first), lengths_by_key(second)
    keys = sorted(set(a) & set(b))
    first_sample, second_sample = [a[k] for k in keys], [b[k] for k in keys]
    # No tau at all with fewer than two prompts, or a sample of one length (every reply cut at a
    # cap): null, not the NaN scipy gives, which is no JSON, and no ceiling fitted to it.
    if len(keys) < 2 or len(set(first_sample)) < 2 or len(set(second_sample)) < 2:
        return {"num_prompts": len(keys), "kendall_tau_two_samples": None}
    if len(keys) < 3:  # too few for the ceiling's model
        return {"num_prompts": len(keys),
                "kendall_tau_two_samples": float(stats.kendalltau(first_sample, second_sample).statistic)}
    return {"num_prompts": len(keys), **ranking_ceiling(first_sample, second_sample)}


def run(args: argparse.Namespace) -> int:
    if args.agreement is not None:
        return report_agreement(args.agreement)
    from engine.llm import LLM

    from_table, rows, max_prompt_tokens = check_before_loading(args)
    llm = LLM(model=args.model)
    append_records(args.log, from_table)  # once the model has loaded: a failed load writes nothing
    added = record_trace(llm, rows, args.log, args.max_tokens, args.temperature, args.window, args.seed,
                         max_prompt_tokens)
    total = write_trace_table(args.log, args.out)
    print(f"traced {added} new prompts; {total} in {args.out}")
    if args.resample_split is not None:
        print(json.dumps(sample_agreement(DEFAULT_TRACE, args.out)))
    return 0


def report_agreement(path: Path) -> int:
    if not path.exists():
        raise ValueError(f"--agreement: no trace table at {path}")
    check_trace_table(path, "--agreement")
    if trace_hash(path) == trace_hash():  # it read a perfect 1.0, the trace against itself
        raise ValueError(f"--agreement {path}: holds the trace itself, not a second sample of its prompts "
                         "(trace --resample-split writes one)")
    agreement = sample_agreement(DEFAULT_TRACE, path)
    if agreement["num_prompts"] < 2:  # no tau to report: it printed NaN, which is no JSON, and exit 0
        raise ValueError(f"--agreement {path}: shares {agreement['num_prompts']} prompts with "
                         f"{DEFAULT_TRACE}; a tau needs at least 2")
    if agreement["kendall_tau_two_samples"] is None:
        raise ValueError(f"--agreement {path}: the prompts it shares with {DEFAULT_TRACE} have one length in "
                         "one of the samples; a tau needs two")
    print(json.dumps(agreement))
    return 0


def trace_sampling(path: Path = DEFAULT_TRACE) -> set[tuple[int, float]]:
    """The (max_tokens, temperature) pairs a trace table's rows were sampled with."""
    records = map(table_record, load_trace(path=path).to_list())
    return {(record.get("max_tokens"), record.get("temperature")) for record in records}


def check_resample_sampling(max_tokens: int, temperature: float) -> None:
    """ValueError unless a resample samples as the trace did: at another cap or temperature, its
    agreement with the trace measured two distributions, not chance (a cap of 8 gave NaN)."""
    sampled = trace_sampling()
    if sampled != {(max_tokens, temperature)}:
        cap, trace_temperature = sorted(sampled)[0]
        raise ValueError(f"--resample-split samples the trace's prompts as the trace did: pass --max-tokens {cap} "
                         f"--temperature {trace_temperature:g} (this run asks {max_tokens} and {temperature:g})")


def check_before_loading(args: argparse.Namespace) -> tuple[list[dict], list[dict], int | None]:
    """Every refusal a trace run can know before the model loads; (the table's records the log
    lacks, the rows to trace, the prompt budget)."""
    from engine.config import EngineConfig
    from engine.llm_engine import check_model_dir

    if args.num_prompts is None:
        raise ValueError("--num-prompts is required (unless --agreement)")
    if args.resample_split is not None and (args.out.resolve() == DEFAULT_TRACE.resolve()
                                            or args.log.resolve() == DEFAULT_LOG.resolve()):
        raise ValueError("--resample-split needs its own --log and --out (not the committed trace's)")
    if args.resample_split is not None and args.seed in trace_seeds():
        raise ValueError(f"--resample-split with --seed {args.seed}, a seed the trace was drawn with, would "
                         "redraw its tokens rather than sample again: pass another --seed")
    if args.resample_split is not None:
        check_resample_sampling(args.max_tokens, args.temperature)
    check_model_dir(args.model)
    max_model_len = EngineConfig(model=args.model).max_model_len  # what LLM(model=...) runs with
    if args.max_tokens >= max_model_len:  # no prompt would fit: it would trace nothing and say so with 0
        raise ValueError(f"--max-tokens {args.max_tokens}: leaves no room for a prompt in the "
                         f"{max_model_len}-token context")
    if args.log.resolve() == args.out.resolve():  # the table would overwrite the log, the resume point
        raise ValueError(f"--out {args.out}: the same file as --log")
    if args.out.is_file():  # resumed from once the model has loaded: a table of another kind fails now
        check_trace_table(args.out, "--out", columns=TRACE_COLUMNS)
    logged = read_resumable_log(args.log)  # likewise the log
    prepare_output_file(args.log, "--log")  # before the model loads and the prompts run
    prepare_output_file(args.out, "--out")
    # The trace's own prompts for a resample, whatever their budget was.
    max_prompt_tokens = None if args.resample_split is not None else min(max_model_len - args.max_tokens,
                                                                          args.max_prompt_tokens)
    # What the run would resume, log and table, sampled as this run would: known before the model loads.
    from_table = records_not_logged(logged, args.out)
    check_resume_settings(logged + from_table, args.max_tokens, args.temperature, args.seed, max_prompt_tokens)
    if args.resample_split is not None:
        rows = trace_rows(args.resample_split)[: args.num_prompts]
    else:
        rows = candidate_rows(max_prompt_tokens, args.seed)[: args.num_prompts]
    if not rows:  # it traced nothing, wrote a table of no rows and no column types, and refused it next run
        where = (f"--resample-split {args.resample_split}: the trace has no prompt there" if args.resample_split
                 else f"--max-prompt-tokens {args.max_prompt_tokens}: no prompt fits")
        raise ValueError(where)
    return from_table, rows, max_prompt_tokens


def read_resumable_log(log_path: Path) -> list[dict]:
    """The records a run resumes from, naming on stderr the damaged lines it skips."""
    if not log_path.is_file():
        return []
    contents = read_log_contents(log_path)
    if contents.damaged_lines:
        print(f"--log {log_path}: skipped unreadable line(s) {', '.join(map(str, contents.damaged_lines))}; "
              "their prompts are traced again", file=sys.stderr)
    return contents.records
