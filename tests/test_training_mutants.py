"""Tests that pin the training pipeline's logic a mutation review found unpinned: each names what
it would catch. Fast, on hand-computed values and small real tables and stores in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import data_prepare, dataset


def test_a_file_cut_right_after_a_whole_record_keeps_every_record(tmp_path: Path):
    # The cut can fall between records: the text then ends where the next record would begin.
    records = [{"id": f"a{i}_0", "conversations": []} for i in range(2)]
    text = json.dumps(records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex("}") + 1], encoding="utf-8")
    assert list(dataset.iter_sharegpt_records(path)) == records
    path.write_text(text[: text.rindex("}") + 1] + ",\n ", encoding="utf-8")  # and just after its comma
    assert list(dataset.iter_sharegpt_records(path)) == records


def test_only_a_trailing_chunk_number_is_the_suffix():
    assert dataset.conversation_id_of("a_1b_2") == "a_1b"  # an inner `_1` is part of the id
    assert dataset.conversation_id_of("abc_") == "abc_"  # no number, no suffix


def test_a_prompt_exactly_at_the_prompt_budget_is_a_trace_candidate(monkeypatch):
    import datasets

    from training import trace

    table = datasets.Dataset.from_dict({
        "conversation_id": ["c0", "c1", "c2"], "turn_index": [0] * 3, "prompt": ["fits", "at the budget", "over"],
        "prompt_tokens": [3, 10, 11], "split": ["train"] * 3, "in_train": [False] * 3})
    monkeypatch.setattr(dataset, "load_turns", lambda split=None: table)
    assert sorted(row["prompt"] for row in trace.candidate_rows(max_prompt_tokens=10, seed=0)) == ["at the budget",
                                                                                                  "fits"]


def _record(key: str, length: int = 3) -> dict:
    return {"key": key, "conversation_id": "c", "turn_index": 0, "prompt": "p", "prompt_tokens": 1,
            "output_tokens": length, "finish_reason": "stop", "split": "test", "in_train": False}


def test_a_log_line_missing_any_record_field_is_refused(tmp_path: Path):
    # Every column the table is written with: a record of key, length and finish reason alone
    # passed, ran the whole trace, and failed writing the table (a KeyError), as every later run.
    from training.trace import TRACE_COLUMNS, read_log

    log = tmp_path / "t.jsonl"
    assert set(_record("k")) == set(TRACE_COLUMNS)
    for field in TRACE_COLUMNS:
        partial = {name: value for name, value in _record("k").items() if name != field}
        log.write_text(json.dumps(_record("a")) + "\n" + json.dumps(partial) + "\n")
        with pytest.raises(ValueError, match="line 2 is no trace record"):
            read_log(log)


def test_cut_lines_between_whole_records_are_skipped_and_an_empty_log_is_empty(tmp_path: Path):
    from training.trace import read_log

    log = tmp_path / "t.jsonl"
    log.write_text("")  # made (touched, or created by a run killed before its first record) but empty
    assert read_log(log) == []
    lines = [json.dumps(_record("a")), '{"key": "cut', json.dumps(_record("b")), '{"key": "cut again', ""]
    log.write_text("\n".join(lines))  # cut writes in the middle, the file ending on a line break
    assert read_log(log) == [_record("a"), _record("b")]
    log.write_text('{"key": "cut\n{"key": "cut again\n')  # lines, none a record: no trace log
    with pytest.raises(ValueError, match="not a trace log"):
        read_log(log)


def test_damaged_lines_are_named_but_an_interrupted_last_line_is_not(tmp_path: Path):
    from training.trace import read_log_contents

    log = tmp_path / "t.jsonl"
    whole = [json.dumps(_record("a")), "garbage", json.dumps(_record("b")), "", json.dumps(_record("c"))]
    log.write_text("\n".join(whole) + '\n{"key": "cut')  # lines 2 and 4 damaged, line 6 cut by an interrupt
    contents = read_log_contents(log)
    assert contents.records == [_record("a"), _record("b"), _record("c")] and contents.damaged_lines == [2, 4]
    log.write_text("\n".join(whole) + '\n{"key": "cut\n')  # ended by a line break: no interrupted write
    assert read_log_contents(log).damaged_lines == [2, 4, 6]


def test_each_prompts_seed_is_its_key_plus_the_run_seed_modulo_a_31_bit_prime():
    # Pinned by hand: the committed trace's rows were drawn with these seeds, so a rerun that
    # derives them otherwise no longer redraws its prompts from the same seeds.
    from training.trace import seed_of

    assert seed_of("0000000000000005", 3) == 8
    assert seed_of("000000007fffffff", 0) == 0  # 2**31 - 1 wraps to 0 ...
    assert seed_of("0000000080000000", 0) == 1  # ... and 2**31 to 1 (modulo 2**31 it would be 0)
    assert seed_of("0000000000000005", 2**31 - 3) == 3


def _trace_rows(count: int) -> list[dict]:
    return [{"key": f"k{i}", "conversation_id": f"c{i}", "turn_index": 0, "prompt": f"p{i}", "prompt_tokens": 5,
             "output_tokens": 10 + i, "finish_reason": "stop", "split": "test", "in_train": False}
            for i in range(count)]


def test_table_rows_copied_into_a_log_after_a_cut_line_are_each_read_back(tmp_path: Path):
    from training import trace

    log, table = tmp_path / "trace.jsonl", tmp_path / "trace.parquet"
    log.write_text("".join(json.dumps(row) + "\n" for row in _trace_rows(3)))
    trace.write_trace_table(log, table)
    # The log holds the first row and a cut second line: the copied rows must start a new line,
    # not continue the cut one (which made the first copied row unreadable, and lost).
    log.write_text(json.dumps(_trace_rows(1)[0]) + '\n{"key": "k1", "outp')
    assert trace.seed_log_from_table(log, table) == 2
    assert [record["key"] for record in trace.read_log(log)] == ["k0", "k1", "k2"]


def test_the_trace_keeps_exactly_window_prompts_in_flight(tmp_path: Path):
    from types import SimpleNamespace

    from training import trace

    class OneAtATimeEngine:  # finishes the oldest request each step
        def __init__(self):
            self.live, self.most_live = [], 0

        def add_request(self, request_id, prompt, params):
            self.live.append(request_id)
            self.most_live = max(self.most_live, len(self.live))

        def step(self):
            done = self.live.pop(0)
            return [SimpleNamespace(request_id=done, finished=True, token_ids=(1, 2, 3), finish_reason="stop")]

    rows = [{**{key: row[key] for key in row if key not in ("output_tokens", "finish_reason")}, "key": f"{i:016x}"}
            for i, row in enumerate(_trace_rows(5))]
    engine = OneAtATimeEngine()
    log = tmp_path / "log.jsonl"
    assert trace.record_trace(SimpleNamespace(engine=engine), rows, log, max_tokens=4, temperature=1.0, window=2,
                              seed=0) == 5
    assert engine.most_live == 2
    assert [(r["key"], r["output_tokens"]) for r in trace.read_log(log)] == [(f"{i:016x}", 3) for i in range(5)]


def test_every_sharegpt_speaker_maps_to_its_chat_role():
    speakers = ["system", "human", "user", "gpt", "chatgpt", "bard", "bing"]
    record = {"conversations": [{"from": speaker, "value": speaker} for speaker in speakers]}
    assert [message["role"] for message in data_prepare.chat_of(record)] == [
        "system", "user", "user", "assistant", "assistant", "assistant", "assistant"]


@pytest.mark.parametrize("bad", [{"from": "weird", "value": "x"}, {"from": "human", "value": None},
                                 {"from": "human"}])
def test_a_record_with_one_unreadable_message_is_dropped_whole(bad):
    # Not the message alone: without it the chat would join turns that were never adjacent.
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, bad,
                                {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}
    assert data_prepare.chat_of(record) is None


@pytest.fixture(scope="module")
def tokenizer():
    return dataset.load_smollm2_tokenizer()


@pytest.mark.integration
def test_a_turn_is_only_a_non_blank_reply_directly_after_a_non_blank_user_message(tokenizer):
    chat = [("gpt", "a leading reply"), ("human", "q1"), ("gpt", "a1"), ("gpt", "a reply after a reply"),
            ("human", "q2"), ("gpt", "  \n"), ("human", "q3")]
    record = {"id": "x_3", "conversations": [{"from": who, "value": text} for who, text in chat]}
    columns = data_prepare.build_turns([record], tokenizer)
    assert (columns.conversation_id, columns.turn_index) == (["x"], [0])
    messages = data_prepare.chat_of(record)
    assert columns.prompt == [tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)]
    assert columns.response_tokens == [len(tokenizer("a1", add_special_tokens=False)["input_ids"])]
    assert columns.split == [dataset.split_of("x")]


def _one_turn_record(name: str) -> dict:
    return {"id": f"{name}_0", "conversations": [{"from": "human", "value": f"question {name}"},
                                                 {"from": "gpt", "value": f"answer {name}"}]}


@pytest.mark.integration
def test_prepare_uses_the_first_limit_records_and_writes_a_card_only_when_asked(tokenizer, tmp_path, monkeypatch):
    names = ["r0", "r1", "r2", "r3"]
    monkeypatch.setattr(dataset, "load_smollm2_tokenizer", lambda: tokenizer)
    monkeypatch.setattr(dataset, "iter_sharegpt_records", lambda: iter([_one_turn_record(n) for n in names]))
    counts = data_prepare.prepare(tmp_path / "turns", tmp_path / "card", limit=2)
    table = _read_turn_table(tmp_path / "turns")
    assert sorted(table["conversation_id"]) == ["r0", "r1"]
    assert counts == {split: table["split"].count(split) for split in dataset.SPLITS}
    assert "2 complete records were parsed" in (tmp_path / "card" / "README.md").read_text()
    data_prepare.prepare(tmp_path / "no-card", None)
    assert sorted(p.name for p in (tmp_path / "no-card").iterdir()) == [f"{s}.parquet" for s in sorted(dataset.SPLITS)]
    assert len(_read_turn_table(tmp_path / "no-card")["split"]) == 4


def _read_turn_table(table_dir: Path) -> dict[str, list]:
    # pyarrow, not load_turns: `datasets` cannot read the empty split files a tiny table has.
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = dataset.table_files(table_dir).values()
    return pa.concat_tables([pq.read_table(path) for path in files]).to_pydict()


def test_the_card_goes_where_asked_beside_the_table_or_nowhere(tmp_path, monkeypatch):
    import argparse

    seen = []
    monkeypatch.setattr(data_prepare, "prepare", lambda out, card_dir, limit: seen.append(card_dir) or {})
    parser = argparse.ArgumentParser()
    data_prepare.add_arguments(parser)
    for flags, card in ((["--card-dir", str(tmp_path / "c")], tmp_path / "c"), ([], tmp_path / "t"),
                        (["--no-card"], None)):
        assert data_prepare.run(parser.parse_args(["--out", str(tmp_path / "t"), *flags])) == 0
        assert seen.pop() == card
    assert data_prepare.default_card_dir(tmp_path / "t") == tmp_path / "t"
    assert data_prepare.default_card_dir(dataset.DEFAULT_TABLE_DIR) == dataset.DEFAULT_TABLE_DIR.parent


def _labelled(count: int, offset: int = 0):
    import numpy as np

    from training.labels import LabelledSplit

    return LabelledSplit([f"prompt {offset + i}" for i in range(count)], np.arange(count, dtype=np.int64) + 1,
                         np.zeros(count, dtype=bool), np.ones(count, dtype=np.int64), np.zeros(count, dtype=bool))


def _prediction_list(lengths):
    from predictor.base import Prediction

    return [Prediction(point=float(n), p50=float(n), p90=float(n) + 1, score=float(n), rank_len=float(n))
            for n in lengths]


def test_embed_lgbm_validates_on_the_champion_selection_rows_and_they_are_scored_without_predicting_again(
        monkeypatch):
    from types import SimpleNamespace

    from scipy import stats

    from training import labels, train

    splits = {"train": _labelled(9000), "validation": _labelled(5000, 10_000), "test": _labelled(3000, 20_000)}
    monkeypatch.setattr(labels, "load_split", lambda split, source="sharegpt", held_out=None: splits[split])
    monkeypatch.setattr(dataset, "table_hash", lambda: "hash")
    data = train.load_data("sharegpt", "embed_lgbm", None, None)
    assert (len(data.train), len(data.valid), len(data.test)) == (8000, 2000, 2000)
    assert data.valid.prompts == labels.subsample(splits["validation"], train.SELECTION_ROWS, seed=1).prompts

    class NeverCalled:
        def predict(self, prompts):
            raise AssertionError("predicted the selection rows again")

    reversed_order = _prediction_list(-data.valid.lengths)
    tau = train.selection_tau(NeverCalled(), data, SimpleNamespace(valid_predictions=reversed_order))
    assert tau == pytest.approx(-1.0)
    # A run that validated on other rows predicts the selection rows itself.
    other = SimpleNamespace(valid=_labelled(10, 30_000))

    class Exact:
        def predict(self, prompts):
            return _prediction_list([1 + int(p.split()[1]) for p in prompts])

    tau = train.selection_tau(Exact(), other, SimpleNamespace(valid_predictions=reversed_order[:10]))
    expected = stats.kendalltau(data.valid.lengths, [1 + int(p.split()[1]) for p in data.valid.prompts]).statistic
    assert tau == pytest.approx(expected) and tau > 0.99


def test_explicit_row_limits_override_each_kinds_defaults_and_the_test_split_keeps_held_out_rows(monkeypatch):
    from training import labels, train

    splits = {"train": _labelled(50), "validation": _labelled(40, 100), "test": _labelled(30, 200)}
    calls = []

    def load_split(split, source="sharegpt", held_out=None):
        calls.append((split, source, held_out))
        return splits[split]

    monkeypatch.setattr(labels, "load_split", load_split)
    monkeypatch.setattr(labels, "trace_held_out", lambda: "HELD")
    monkeypatch.setattr(labels, "trace_held_out_tag", lambda: "trace:tag")
    monkeypatch.setattr(labels, "trace_hash", lambda: "trace-hash")
    monkeypatch.setattr(dataset, "table_hash", lambda: "table-hash")
    data = train.load_data("sharegpt", "embed_lgbm", 7, 5, hold_out_trace=True)
    assert (len(data.train), len(data.valid), len(data.test)) == (7, 5, 5)
    assert calls == [("train", "sharegpt", "HELD"), ("validation", "sharegpt", "HELD"), ("test", "sharegpt", None)]
    assert (data.data_hash, data.held_out) == ("table-hash", "trace:tag")
    data = train.load_data("trace", "lexical", None, None)
    assert (len(data.train), len(data.valid), len(data.test)) == (50, 40, 30)
    assert (data.data_hash, data.held_out) == ("trace-hash", "")


def _saved_length_predictor(folder: Path, intercept: float) -> Path:
    from predictor.length import LengthParams, LengthPredictor
    from predictor.saved import PredictorSpec, save

    spec = PredictorSpec(kind="length", feature_spec={}, data_hash="h")
    return save(LengthPredictor(LengthParams(intercept, 0.1, 0.0, 0.5), spec), folder)


def test_no_run_or_only_runs_without_the_selection_tau_crown_no_champion(tmp_path: Path):
    import mlflow

    from training import tracking

    store = tmp_path / "mlruns"
    with tracking.tracking_session(store):
        assert tracking.update_champion() is None  # an empty experiment: nothing to crown
        folder = _saved_length_predictor(tmp_path / "p", 1.0)
        tracking.log_run("own rows", {"model": "length"}, {"val_kendall_tau": 0.9}, folder, [],
                         tracking.comparison_tags("sharegpt", ""))
        assert tracking.best_run_id() is None and tracking.update_champion() is None
        assert mlflow.MlflowClient().search_registered_models() == []
    with pytest.raises(LookupError, match="no 'champion' alias"):
        tracking.download_champion(store=store)


def test_a_tracking_session_leaves_the_tracking_and_registry_uris_as_it_found_them(tmp_path: Path):
    import mlflow

    from training import tracking

    before, registry_before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    with tracking.tracking_session(tmp_path / "mlruns") as uri:
        assert mlflow.get_tracking_uri() == uri == tracking.tracking_uri(tmp_path / "mlruns")
        assert mlflow.get_registry_uri() == uri
    assert mlflow.get_tracking_uri() == before
    assert mlflow.get_registry_uri() == registry_before != uri  # the registry had stayed on the session's store


def test_trace_folds_keep_each_conversation_in_one_fold(monkeypatch):
    from training import labels, trace

    prompts = [f"prompt {i}" for i in range(9)]
    conversations = ["a", "a", "a", "b", "b", "c", "c", "c", "c"]
    monkeypatch.setattr(trace, "load_trace", lambda: {"key": [trace.prompt_key(p) for p in prompts],
                                                      "conversation_id": conversations})
    folds = labels.trace_cv_folds(prompts, 3)
    assert len(folds) == 3
    held_sets = []
    for train_rows, held_rows in folds:
        held = {conversations[row] for row in held_rows}
        assert held.isdisjoint(conversations[row] for row in train_rows) and len(held) == 1
        held_sets.append(held)
    assert sorted(sorted(fold)[0] for fold in held_sets) == ["a", "b", "c"]


@pytest.mark.integration
def test_the_last_message_check_reads_the_train_split_only():
    from predictor.features import parse_prompt
    from training.labels import last_message_in_train

    def requests(split: str) -> list[str]:
        return [parse_prompt(prompt).request for prompt in dataset.load_turns(split)["prompt"]]

    train, validation = requests("train"), set(requests("validation"))
    train_only = next(r for r in train if r not in validation and r.strip())
    validation_only = next(r for r in sorted(validation - set(train)) if r.strip())

    def chat(text: str) -> str:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    assert last_message_in_train([chat(train_only), chat(validation_only)]).tolist() == [True, False]


def _trace_run_on_a_fake_engine(tmp_path: Path, monkeypatch, flags: list[str], context: int = 300) -> list[int]:
    """`trace.run` with the model, engine and tracing faked; the prompt budgets it asked candidates for."""
    import argparse
    from types import SimpleNamespace

    import engine.config
    import engine.llm
    import engine.llm_engine
    from training import trace

    monkeypatch.setattr(engine.llm_engine, "check_model_dir", lambda model: None)
    monkeypatch.setattr(engine.config, "EngineConfig", lambda model: SimpleNamespace(max_model_len=context))
    monkeypatch.setattr(engine.llm, "LLM", lambda model: SimpleNamespace(
        engine=SimpleNamespace(config=SimpleNamespace(max_model_len=context))))
    asked = []
    monkeypatch.setattr(trace, "candidate_rows", lambda tokens, seed: asked.append(tokens) or [{"key": "k"}])
    monkeypatch.setattr(trace, "record_trace", lambda *args: 0)
    monkeypatch.setattr(trace, "write_trace_table", lambda log, out: 0)
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "3", "--log", str(tmp_path / "t.jsonl"),
                              "--out", str(tmp_path / "t.parquet"), *flags])
    assert trace.run(args) == 0
    return asked


@pytest.mark.parametrize("max_prompt_tokens, budget", [(384, 44), (20, 20)])
def test_trace_candidates_fit_the_context_with_room_for_the_reply(tmp_path, monkeypatch, max_prompt_tokens, budget):
    flags = ["--max-tokens", "256", "--max-prompt-tokens", str(max_prompt_tokens)]
    assert _trace_run_on_a_fake_engine(tmp_path, monkeypatch, flags) == [budget]


def test_a_reply_cap_of_the_whole_context_is_refused(tmp_path, monkeypatch):
    assert _trace_run_on_a_fake_engine(tmp_path, monkeypatch, ["--max-tokens", "299"]) == [1]
    with pytest.raises(ValueError, match="leaves no room for a prompt in the 300-token context"):
        _trace_run_on_a_fake_engine(tmp_path, monkeypatch, ["--max-tokens", "300"])


@pytest.mark.integration
def test_the_committed_trace_is_the_first_candidates_of_its_settings():
    # So a rerun with the committed settings and a larger --num-prompts extends the trace with the
    # next prompts of the same seeded order (a changed order or fit rule would trace others).
    from training import trace

    table = trace.load_trace()
    max_prompt_tokens = trace.LEGACY_TABLE_SETTINGS["max_prompt_tokens"]  # the committed run's budget
    assert max_prompt_tokens == min(2048 - trace.LEGACY_TABLE_SETTINGS["max_tokens"], 384)
    rows = trace.candidate_rows(max_prompt_tokens, seed=trace.LEGACY_TRACE_SEED)[: len(table)]
    assert {row["key"]: row["split"] for row in rows} == dict(zip(table["key"], table["split"]))


def test_the_card_counts_conversations_turns_and_in_train_rows_per_split(tmp_path: Path):
    from training import data_card

    columns = data_prepare.TurnColumns(
        conversation_id=["a", "a", "b", "c", "d", "d"], turn_index=[0, 1, 0, 0, 0, 1],
        prompt=["p"] * 6, prompt_tokens=[10, 20, 30, 40, 50, 1000], response_tokens=[1, 2, 3, 4, 5, 601],
        split=["train", "train", "train", "test", "validation", "validation"],
        in_train=[True, True, True, True, False, True])
    card = data_card.write_card(columns, num_records=4, out_dir=tmp_path).read_text()
    assert "| train | 2 | 3 | 3 |" in card
    assert "| validation | 1 | 2 | 1 |" in card
    assert "| test | 1 | 1 | 1 |" in card
    assert "Turns: 6." in card
    assert "| 1000 | 192 |" in card and "| 601 | 103 |" in card  # max and mean of each column
    assert (tmp_path / data_card.HISTOGRAM_NAME).stat().st_size > 0


def test_the_champion_downloads_from_a_store_that_cannot_be_written(tmp_path: Path, monkeypatch):
    # A server may read a store it may not write (a read-only mount: even root cannot write there,
    # so the write probe is made to fail here).
    import engine.arg_types
    import predictor
    from training import serve_predictor, tracking

    store = tmp_path / "mlruns"
    with tracking.tracking_session(store):
        folder = _saved_length_predictor(tmp_path / "p", 3.0)
        run_id = tracking.log_run("p", {"model": "length"}, {tracking.SELECTION_METRIC: 0.5}, folder, [],
                                  tracking.comparison_tags("sharegpt", ""))
        assert tracking.update_champion() == run_id

    def read_only(write, path, flag):
        raise PermissionError(f"{flag} {path}: not writable (read-only file system)")

    monkeypatch.setattr(engine.arg_types, "_try_writing", read_only)
    with pytest.raises(PermissionError):
        tracking.check_store(store)
    assert predictor.load(tracking.download_champion(tmp_path / "got", store=store)).params.intercept == 3.0
    resolved = serve_predictor.champion_or_default(store, tmp_path / "no-default")
    assert predictor.load(resolved).params.intercept == 3.0


def test_the_parity_check_reads_every_row_of_a_table_smaller_than_its_sample():
    def whitespace_tokenizer(texts, add_special_tokens):
        return {"input_ids": [text.split() for text in texts]}

    prompts = [f"prompt {'word ' * i}" for i in range(5)]
    for corrupted in range(5):
        counts = [len(prompt.split()) for prompt in prompts]
        counts[corrupted] += 1
        columns = data_prepare.TurnColumns(prompt=prompts, prompt_tokens=counts)
        with pytest.raises(RuntimeError, match=f"row {corrupted}:"):
            data_prepare.check_prompt_token_parity(columns, whitespace_tokenizer)


@pytest.mark.parametrize("flags, message", [
    (["--model", "lexical", "--labels", "trace", "--prior", "p"], "--prior applies to"),
    (["--model", "embed_lgbm", "--labels", "sharegpt", "--prior", "p"], "--prior applies to"),
    (["--model", "lexical", "--labels", "trace", "--hold-out-trace"], "--hold-out-trace applies to"),
    (["--model", "embed_lgbm", "--lora-rank", "2"], "--lora-rank applies to --model finetune only"),
    (["--model", "finetune", "--probe-tokens", "128"], "--probe-tokens applies to --model probe only"),
    # Accepted and ignored before: the default seed 0 could not be told from one given.
    (["--model", "length", "--seed", "3"], "--seed: --model length fits deterministically"),
    (["--model", "probe", "--seed", "0"], "--seed: --model probe fits deterministically"),
])
def test_train_refuses_a_prior_or_a_held_out_trace_it_cannot_use_before_loading_data(flags, message, monkeypatch):
    import argparse

    from training import train

    monkeypatch.setattr(train, "load_data", lambda *args: pytest.fail("loaded the data first"))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        train.train_and_log(parser.parse_args(flags))


def test_a_training_run_competes_for_champion_only_on_its_own_table_and_without_held_out_rows(
        tmp_path: Path, monkeypatch):
    import argparse

    import mlflow
    import numpy as np

    import predictor
    from training import tracking, train, train_models
    from training.train_models import TrainedModel, TrainingData

    store = tmp_path / "mlruns"
    with tracking.tracking_session(store):  # a better run, but on another turn table,
        other = tracking.log_run("other", {"model": "length"}, {tracking.SELECTION_METRIC: 0.9},
                                 _saved_length_predictor(tmp_path / "other", 9.0), [],
                                 {"data_hash": "other-table", **tracking.comparison_tags("sharegpt", "")})
        # and a worse one on this table, logged but not yet reconciled into the registry
        tracking.log_run("pending", {"model": "length"}, {tracking.SELECTION_METRIC: 0.1},
                         _saved_length_predictor(tmp_path / "pending", 1.0), [],
                         {"data_hash": "this-table", **tracking.comparison_tags("sharegpt", "")})
    split = _labelled(30)
    held_out = {"value": ""}
    monkeypatch.setattr(train, "load_data", lambda *args: TrainingData(
        split, split, split, labels="sharegpt", data_hash="this-table", held_out=held_out["value"]))
    monkeypatch.setattr(train, "selection_tau", lambda *args: 0.3)
    fitted = _saved_length_predictor(tmp_path / "fitted", 4.0)

    def fake_trainer(data, config):
        guesses = _prediction_list(np.arange(len(data.valid)) + 1)
        return TrainedModel(predictor.load(fitted), guesses, guesses)

    monkeypatch.setitem(train_models.TRAINERS, "length", fake_trainer)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    train.train_and_log(parser.parse_args(["--model", "length", "--store", str(store), "--no-register"]))
    with pytest.raises(LookupError, match="no 'champion' alias"):  # --no-register leaves the registry alone
        tracking.download_champion(store=store)
    args = parser.parse_args(["--model", "length", "--store", str(store)])
    run_id, metrics = train.train_and_log(args)
    assert metrics[tracking.SELECTION_METRIC] == 0.3
    with tracking.tracking_session(store):
        alias = mlflow.MlflowClient().get_model_version_by_alias(tracking.MODEL_NAME, tracking.CHAMPION_ALIAS)
        assert alias.run_id == run_id != other  # the 0.9 run scored its tau on other selection rows
    held_out["value"] = "trace:0123"
    _, metrics = train.train_and_log(args)
    assert tracking.SELECTION_METRIC not in metrics  # scored on a smaller validation split: no candidate


def test_the_trainer_config_carries_the_seed_or_the_probes_token_count():
    import argparse

    from predictor.probe import ProbeConfig
    from training import fitters, train
    from training.finetune_train import FinetuneConfig

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert train.trainer_config(parser.parse_args(["--model", "lexical", "--seed", "3"])) == fitters.LgbmConfig(seed=3)
    assert train.trainer_config(parser.parse_args(["--model", "lexical"])) == fitters.LgbmConfig(seed=0)
    assert train.trainer_config(parser.parse_args(["--model", "probe", "--probe-tokens", "7"])).max_tokens == 7
    assert train.trainer_config(parser.parse_args(["--model", "probe"])) == ProbeConfig()  # its 64 tokens
    assert train.trainer_config(parser.parse_args(["--model", "finetune", "--seed", "5"])) == FinetuneConfig(seed=5)
    assert train.trainer_config(parser.parse_args(["--model", "finetune", "--lora-rank", "2"])) == FinetuneConfig(
        lora_rank=2)


def test_cached_embeddings_mark_and_zero_the_prompts_not_in_the_cache(tmp_path: Path):
    import numpy as np

    from training import embedding_cache

    class Config:  # what the cache reads of an encoder config
        def key_text(self, prompt):
            return prompt.lower()

        def cache_identity(self):
            return {"encoder": "fake"}

        def as_dict(self):
            return self.cache_identity()

    class Encoder:
        config = Config()

        def encode(self, texts):
            return np.asarray([[len(text), 1.0] for text in texts], dtype=np.float32)

    config = Config()
    assert embedding_cache.fill_cache(["ab", "AB", "abcd"], config, root=tmp_path, encoder=Encoder()) == 2
    vectors, found = embedding_cache.cached_embeddings(["abcd", "new", "Ab"], config, root=tmp_path)
    assert found.tolist() == [True, False, True]
    assert vectors.tolist() == [[4.0, 1.0], [0.0, 0.0], [2.0, 1.0]]


def test_a_card_without_hand_written_sections_is_rebuilt_the_same(tmp_path: Path):
    from training import data_card

    columns = data_prepare.TurnColumns(conversation_id=["a"], turn_index=[0], prompt=["p"], prompt_tokens=[5],
                                       response_tokens=[7], split=["train"], in_train=[True])
    first = data_card.write_card(columns, num_records=1, out_dir=tmp_path).read_text()
    assert data_card.write_card(columns, num_records=1, out_dir=tmp_path).read_text() == first


@pytest.mark.integration
def test_a_loaded_split_keeps_the_tables_in_train_flags():
    import numpy as np

    from training.labels import load_split

    split = load_split("test")
    flags = np.asarray(dataset.load_turns("test")["in_train"], dtype=bool)
    assert flags.any() and not flags.all()
    assert split.in_train.tolist() == flags.tolist()


def test_a_file_in_place_of_a_store_is_refused_for_reading_too(tmp_path: Path):
    from training import tracking

    (tmp_path / "mlruns").write_text("not a store")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        tracking.check_store(tmp_path / "mlruns", for_writing=False)
