"""`lengthwise data prepare`: build the ShareGPT turn table and its data card.

Algorithm. Each complete ShareGPT record becomes a chat (human/user -> "user", gpt/chatgpt/bard/
bing -> "assistant", system -> "system"). Every assistant message that directly follows a
non-blank user message is one turn: its prompt is the SmolLM2 chat template of the chat so far
with the generation prompt appended, its label the assistant message's length in SmolLM2 tokens
(content only, without the end-of-turn token).

Prompt token counts are summed per message instead of tokenizing every cumulative prompt (which
would be quadratic in conversation length): the template puts a special token at both ends of
each message, and the tokenizer splits on special tokens first, so the pieces tokenize
independently. A random sample of prompts is tokenized whole to check that identity on every run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from engine.arg_types import check_output_location, named_path, positive_int, prepare_output_dir
from training import dataset

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "system": "system"}
TOKENIZE_BATCH = 2048
PARITY_SAMPLE = 200


@dataclass
class TurnColumns:
    """Column-wise rows of the turn table (names and order as `dataset.TURN_COLUMNS`)."""

    conversation_id: list[str] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    prompt: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    split: list[str] = field(default_factory=list)
    in_train: list[bool] = field(default_factory=list)


def render_message(role: str, content: str) -> str:
    """One message as the SmolLM2 template writes it (checked against the template in tests)."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def count_tokens(tokenizer, texts: list[str], desc: str) -> list[int]:
    counts: list[int] = []
    for start in tqdm(range(0, len(texts), TOKENIZE_BATCH), desc=desc, unit="batch"):
        batch = tokenizer(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False)
        counts.extend(len(ids) for ids in batch["input_ids"])
    return counts


def template_overheads(tokenizer) -> tuple[int, int]:
    """Tokens of the default system block and of the generation prompt."""
    empty_user = [{"role": "user", "content": ""}]
    with_prompt = tokenizer.apply_chat_template(empty_user, tokenize=False, add_generation_prompt=True)
    user_piece = render_message("user", "")
    system_block, generation_prompt = with_prompt.split(user_piece)
    counts = count_tokens(tokenizer, [system_block, generation_prompt], "template")
    return counts[0], counts[1]


def chat_of(record: dict) -> list[dict] | None:
    messages = []
    for message in record.get("conversations") or []:
        role = ROLES.get(message.get("from"))
        if role is None or not isinstance(message.get("value"), str):
            return None
        messages.append({"role": role, "content": message["value"]})
    return messages


def build_turns(records, tokenizer) -> TurnColumns:
    """All turns of `records`; fills every column but `in_train`."""
    columns = TurnColumns()
    pieces: list[str] = []  # every message rendered once; token counts are summed from these
    contents: list[str] = []  # the content of each piece: a reply's length counts content only
    turn_history: list[tuple[int, int, bool]] = []  # (first piece, reply piece, has system)
    for record in tqdm(records, desc="turns", unit="conv"):
        messages = chat_of(record)
        if not messages:
            continue
        conversation_id = dataset.conversation_id_of(record["id"])
        first_piece, human_turns = len(pieces), 0
        for position, message in enumerate(messages):
            previous = messages[position - 1] if position else None
            is_turn = (message["role"] == "assistant" and previous is not None
                       and previous["role"] == "user" and previous["content"].strip()
                       and message["content"].strip())
            if is_turn:
                columns.conversation_id.append(conversation_id)
                columns.turn_index.append(human_turns - 1)
                columns.prompt.append(tokenizer.apply_chat_template(
                    messages[:position], tokenize=False, add_generation_prompt=True))
                columns.split.append(dataset.split_of(conversation_id))
                turn_history.append((first_piece, len(pieces), messages[0]["role"] == "system"))
            human_turns += message["role"] == "user"
            pieces.append(render_message(message["role"], message["content"]))
            contents.append(message["content"])
    _fill_token_counts(columns, tokenizer, pieces, turn_history, contents)
    return columns


def _fill_token_counts(columns, tokenizer, pieces, turn_history, contents) -> None:
    piece_tokens = count_tokens(tokenizer, pieces, "prompt tokens")
    prefix = [0]
    for count in piece_tokens:
        prefix.append(prefix[-1] + count)
    system_tokens, generation_tokens = template_overheads(tokenizer)
    reply_indices = [reply for _, reply, _ in turn_history]
    columns.response_tokens = count_tokens(tokenizer, [contents[i] for i in reply_indices], "reply tokens")
    for first, reply, has_system in turn_history:
        overhead = generation_tokens + (0 if has_system else system_tokens)
        columns.prompt_tokens.append(prefix[reply] - prefix[first] + overhead)


def check_prompt_token_parity(columns: TurnColumns, tokenizer, sample: int = PARITY_SAMPLE) -> None:
    """The summed counts must equal tokenizing the whole prompt; raises on any mismatch."""
    rows = random.Random(0).sample(range(len(columns.prompt)), min(sample, len(columns.prompt)))
    whole = count_tokens(tokenizer, [columns.prompt[row] for row in rows], "parity check")
    for row, expected in zip(rows, whole):
        if columns.prompt_tokens[row] != expected:
            raise RuntimeError(f"prompt token count of row {row}: summed {columns.prompt_tokens[row]}, "
                               f"whole {expected}")


def mark_in_train(columns: TurnColumns) -> None:
    def key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()

    train_prompts = {key(p) for p, s in zip(columns.prompt, columns.split) if s == "train"}
    columns.in_train = [key(prompt) in train_prompts for prompt in columns.prompt]


def write_table(columns: TurnColumns, table_dir: Path) -> dict[str, int]:
    """One zstd parquet file per split; returns the row count of each. Every split is written
    beside its file first and the three renamed into place only once all are whole: an interrupt
    during the minute of writing must not leave splits of two builds side by side, whose in_train
    flags would name a train split that is not there."""
    table_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: getattr(columns, name) for name in dataset.TURN_COLUMNS})
    counts, written = {}, []
    for split_name, path in dataset.table_files(table_dir).items():
        part = table.filter(pa.compute.equal(table["split"], split_name))
        partial = Path(path).with_name(f".{Path(path).name}.partial")
        # Level 19 and large pages let zstd see the prefix each turn shares with the one before:
        # the table is committed, so its size matters more than the minute it takes to write.
        pq.write_table(part, partial, compression="zstd", compression_level=19,
                       data_page_size=8 << 20, row_group_size=100_000)
        written.append((partial, path))
        counts[split_name] = part.num_rows
    for partial, path in written:
        os.replace(partial, path)
    return counts


def prepare(table_dir: Path, card_dir: Path | None, limit: int | None = None) -> dict[str, int]:
    tokenizer = dataset.load_smollm2_tokenizer()
    records = list(dataset.iter_sharegpt_records())
    if limit is not None:
        records = records[:limit]
    columns = build_turns(records, tokenizer)
    check_prompt_token_parity(columns, tokenizer)
    mark_in_train(columns)
    counts = write_table(columns, table_dir)
    if card_dir is not None:
        from training import data_card

        data_card.write_card(columns, num_records=len(records), out_dir=card_dir)
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=named_path, default=dataset.DEFAULT_TABLE_DIR,
                        help="folder for the per-split parquet files")
    parser.add_argument("--card-dir", type=named_path, default=None,
                        help="where README.md (data card) and its histogram go (default: data/ for the "
                             "committed table, else the --out folder itself)")
    parser.add_argument("--no-card", action="store_true", help="skip the data card")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N records")


def default_card_dir(table_dir: Path) -> Path:
    """data/ beside the committed table; any other table keeps its card inside its own folder, so a
    trial run (--limit, another --out) never replaces data/README.md, nor a README above it."""
    if table_dir.resolve() == dataset.DEFAULT_TABLE_DIR.resolve():
        return dataset.DEFAULT_TABLE_DIR.parent
    return table_dir


def run(args: argparse.Namespace) -> int:
    if args.no_card and args.card_dir is not None:  # the folder would be ignored without a word
        raise ValueError("--card-dir names where the card goes, --no-card skips it: give one of them")
    card_dir = None if args.no_card else (args.card_dir or default_card_dir(Path(args.out)))
    # Before minutes of parsing and tokenizing, not after; both checked before either is made.
    check_output_location(args.out, "--out", folder=True)
    if card_dir is not None:
        from training import data_card

        check_output_location(card_dir, "--card-dir", folder=True)
        data_card.check_card_location(card_dir)
    prepare_output_dir(args.out, "--out")
    if card_dir is not None:
        prepare_output_dir(card_dir, "--card-dir")
    counts = prepare(args.out, card_dir, args.limit)
    print(f"wrote {sum(counts.values())} turns to {args.out}: {counts}")
    return 0
