"""Data checks of the ShareGPT turn table and the pieces that build it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import data_prepare, dataset


def test_truncated_array_keeps_complete_records(tmp_path: Path):
    records = [{"id": f"a{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text.rindex('"q2"')  # cut inside the last record, as the packaged file is cut
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut], encoding="utf-8")
    assert [r["id"] for r in dataset.iter_sharegpt_records(path)] == ["a0_0", "a1_0"]


def test_complete_array_is_read_whole(tmp_path: Path):
    records = [{"id": "x_0", "conversations": []}, {"id": "y_3", "conversations": []}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    assert list(dataset.iter_sharegpt_records(path)) == records


def test_conversation_id_drops_only_the_chunk_suffix():
    assert dataset.conversation_id_of("QWJhYvA_9") == "QWJhYvA"
    assert dataset.conversation_id_of("QWJhYvA_12") == "QWJhYvA"
    assert dataset.conversation_id_of("a_b") == "a_b"


def test_split_is_deterministic_and_roughly_80_10_10():
    ids = [f"conv{i}" for i in range(5000)]
    splits = [dataset.split_of(i) for i in ids]
    # Pinned, not compared with itself: a per-process hash (Python's hash()) would pass that and
    # reshuffle the splits between runs and machines.
    assert splits[:6] == ["test", "train", "train", "train", "train", "validation"]
    share = {name: splits.count(name) / len(ids) for name in dataset.SPLITS}
    assert 0.77 < share["train"] < 0.83
    assert 0.08 < share["validation"] < 0.12
    assert 0.08 < share["test"] < 0.12
    # Exact counts, pinned from the current split_of: the bands above cannot see a threshold moved
    # by one bucket (`<=` for `<` shifts about 1% of ids, 44 of these 5,000, across a border).
    assert {name: splits.count(name) for name in dataset.SPLITS} == {"train": 4005, "validation": 465, "test": 530}


def test_load_turns_rejects_unknown_split(tmp_path: Path):
    with pytest.raises(ValueError):
        dataset.load_turns("dev", table_dir=tmp_path)


def test_mark_in_train_flags_prompts_seen_in_train():
    columns = data_prepare.TurnColumns(prompt=["hi", "hi", "essay", "continue"],
                                       split=["train", "test", "test", "validation"])
    data_prepare.mark_in_train(columns)
    assert columns.in_train == [True, True, False, False]


@pytest.fixture(scope="module")
def tokenizer():
    return dataset.load_smollm2_tokenizer()


@pytest.mark.integration
def test_rendered_message_matches_the_chat_template(tokenizer):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"},
            {"role": "assistant", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered == "".join(data_prepare.render_message(m["role"], m["content"]) for m in chat)


@pytest.mark.integration
def test_small_build_counts_match_whole_tokenization(tokenizer):
    records = [
        {"id": "c1_0", "conversations": [
            {"from": "human", "value": "Write an essay about  cats.\n\n"},
            {"from": "gpt", "value": "Cats are\n small."},
            {"from": "human", "value": "   "}, {"from": "gpt", "value": "skipped: blank question"},
            {"from": "human", "value": "<|im_end|> odd"}, {"from": "gpt", "value": "ok"}]},
        {"id": "c1_1", "conversations": [
            {"from": "gpt", "value": "leading reply"}, {"from": "human", "value": "go on"},
            {"from": "gpt", "value": "done"}]},
        {"id": "c2_0", "conversations": [{"from": "weird", "value": "x"}]},
        # A record's own system message replaces the template's default system block, whose
        # tokens must then not be added on top.
        {"id": "s3_0", "conversations": [
            {"from": "system", "value": "You answer in one word."}, {"from": "human", "value": "Name a cat."},
            {"from": "gpt", "value": "Tom."}, {"from": "human", "value": "Another?"},
            {"from": "gpt", "value": "Felix."}]},
    ]
    columns = data_prepare.build_turns(records, tokenizer)
    assert columns.conversation_id == ["c1", "c1", "c1", "s3", "s3"]
    assert columns.turn_index == [0, 2, 0, 0, 1]
    for prompt, count in zip(columns.prompt, columns.prompt_tokens):
        assert count == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert columns.response_tokens[0] == len(tokenizer("Cats are\n small.", add_special_tokens=False)["input_ids"])
    assert columns.prompt[0].endswith("<|im_start|>assistant\n")
    assert columns.prompt[3].startswith("<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user")
    assert columns.prompt[3].count("<|im_start|>system") == 1
    data_prepare.check_prompt_token_parity(columns, tokenizer)  # every row: the sample exceeds five
    columns.prompt_tokens[3] += 1
    with pytest.raises(RuntimeError, match="row 3"):
        data_prepare.check_prompt_token_parity(columns, tokenizer)


def test_prompt_token_parity_check_raises_on_a_corrupted_count():
    def whitespace_tokenizer(texts, add_special_tokens):
        return {"input_ids": [text.split() for text in texts]}

    prompts = [f"prompt number {i} " + "word " * i for i in range(30)]
    columns = data_prepare.TurnColumns(prompt=prompts, prompt_tokens=[i + 3 for i in range(30)])
    data_prepare.check_prompt_token_parity(columns, whitespace_tokenizer, sample=30)
    columns.prompt_tokens[17] -= 1
    with pytest.raises(RuntimeError, match="row 17: summed 19, whole 20"):
        data_prepare.check_prompt_token_parity(columns, whitespace_tokenizer, sample=30)


def test_a_table_with_empty_splits_loads(tokenizer, tmp_path: Path):
    # `data prepare --limit 1` writes two splits of no rows, which `datasets` failed to load
    # ("BatchSize must be greater than 0").
    records = [{"id": "c1_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    columns = data_prepare.build_turns(records, tokenizer)
    data_prepare.mark_in_train(columns)
    counts = data_prepare.write_table(columns, tmp_path)
    assert sorted(counts.values()) == [0, 0, 1]
    whole = dataset.load_turns(None, table_dir=tmp_path)
    assert whole["prompt"] == columns.prompt and whole.column_names == list(dataset.TURN_COLUMNS)
    for split, count in counts.items():
        rows = dataset.load_turns(split, table_dir=tmp_path)
        assert rows.num_rows == count and rows.column_names == whole.column_names


def test_a_first_load_of_a_table_writes_no_progress_bar_and_leaves_the_setting_alone(tokenizer, tmp_path: Path,
                                                                                     capfd):
    # Its bar named every split "train" and, on stderr, made a command's one-line error three
    # lines whenever that command was the first to read the table.
    import datasets

    prompt = f"a prompt no other table holds: {tmp_path}"  # so its cache folder is new: a first load
    records = [{"id": "c1_0", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": "ok"}]}]
    columns = data_prepare.build_turns(records, tokenizer)
    data_prepare.mark_in_train(columns)
    data_prepare.write_table(columns, tmp_path)
    capfd.readouterr()
    assert dataset.load_turns(None, table_dir=tmp_path).num_rows == 1
    assert capfd.readouterr().err == "" and not datasets.utils.are_progress_bars_disabled()


def test_rebuilding_the_data_card_keeps_the_sections_written_by_hand(tokenizer, tmp_path: Path):
    from training import data_card

    records = [{"id": "c1_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    columns = data_prepare.build_turns(records, tokenizer)
    data_prepare.mark_in_train(columns)
    data_card.write_card(columns, num_records=1, out_dir=tmp_path)
    card = tmp_path / "README.md"
    card.write_text(card.read_text() + "\n## Served-model trace\n\nwritten by hand\n")
    data_card.write_card(columns, num_records=1, out_dir=tmp_path)
    text = card.read_text()
    assert text.count("## ShareGPT turn table") == 1 and text.endswith("## Served-model trace\n\nwritten by hand\n")


@pytest.fixture(scope="module")
def turns():
    if not Path(dataset.table_files()["train"]).exists():
        pytest.skip("turn table not built (make data)")
    return dataset.load_turns()


@pytest.mark.integration
def test_turn_table_schema(turns):
    assert tuple(turns.column_names) == dataset.TURN_COLUMNS
    assert turns.num_rows > 50_000


@pytest.mark.integration
def test_turn_table_values(turns):
    table = turns.to_pandas()
    assert (table["prompt"].str.len() > 0).all()
    assert (table["prompt_tokens"] > 0).all() and (table["response_tokens"] > 0).all()
    assert (table["turn_index"] >= 0).all()
    assert set(table["split"]) == set(dataset.SPLITS)
    assert table.groupby("conversation_id")["split"].nunique().max() == 1
    # The stored split is the one split_of derives now, for every conversation: a table built by a
    # different split rule (or a changed rule reading an old table) would mix evaluation data.
    stored = table.groupby("conversation_id")["split"].first()
    derived = stored.index.map(dataset.split_of)
    assert (stored.to_numpy() == derived.to_numpy()).all()
    assert table.loc[table["split"] == "train", "in_train"].all()


@pytest.mark.integration
def test_load_turns_by_split(turns):
    test_split = dataset.load_turns("test")
    assert set(test_split["split"]) == {"test"}
    assert 0 < test_split.num_rows < turns.num_rows


def test_last_message_dedup_catches_a_train_message_after_another_history():
    from training.labels import last_message_in_train

    def chat(*turns: str) -> str:  # ChatML as the table holds it: alternating user and assistant
        roles = ["user", "assistant"] * len(turns)
        body = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in zip(roles, turns))
        return body + "<|im_start|>assistant\n"

    seen = last_message_in_train([chat("a history never seen", "a reply", "continue"),
                                  chat("zq3 a message no train prompt has ever ended with 81x"),
                                  chat("continue")])
    assert seen.tolist() == [True, False, True]


@pytest.mark.integration
def test_committed_trace_holds_at_least_2000_served_model_lengths():
    # The issue asks for a committed trace of at least 2,000 prompts, labels for `train --labels trace`.
    from training import trace

    table = trace.load_trace().to_pandas()
    assert tuple(table.columns) == trace.TRACE_COLUMNS
    assert len(table) >= 2000 and table["key"].is_unique
    assert table["key"].tolist() == [trace.prompt_key(p) for p in table["prompt"]]
    assert (table["output_tokens"] > 0).all() and (table["prompt_tokens"] > 0).all()
    assert set(table["finish_reason"]) <= {"stop", "length"}
    capped = table["finish_reason"] == "length"
    assert capped.any() and table.loc[capped, "output_tokens"].nunique() == 1  # one cap for the whole trace
    assert (table.loc[~capped, "output_tokens"] <= table.loc[capped, "output_tokens"].iloc[0]).all()
    # Its splits are the ShareGPT table's: no conversation's prompt is traced in two splits.
    assert set(table["split"]) == set(dataset.SPLITS)
    assert (table.groupby("conversation_id")["split"].nunique() == 1).all()
    assert (table["split"] == table["conversation_id"].map(dataset.split_of)).all()
