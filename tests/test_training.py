"""Training pieces: ranking losses, metrics, lambdarank queries, MLflow registry of the champion."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import predictor
from predictor.base import Prediction
from predictor.saved import PredictorSpec
from training import fitters, metrics, tracking
from training.finetune_train import FinetuneConfig, listmle_loss, pinball_loss, warmup_then_linear_decay


def _plackett_luce_nll(scores: list[float], order: list[int]) -> float:
    """-log P(order | scores) under Plackett-Luce, written out directly."""
    remaining, total = list(order), 0.0
    for item in order:
        total -= scores[item] - math.log(sum(math.exp(scores[r]) for r in remaining))
        remaining.remove(item)
    return total


def test_listmle_equals_plackett_luce_likelihood():
    scores = torch.tensor([0.3, -1.2, 2.0, 0.5])
    lengths = torch.tensor([10.0, 300.0, 50.0, 7.0])  # longest first: 1, 2, 0, 3
    expected = _plackett_luce_nll(scores.tolist(), [1, 2, 0, 3]) / 4
    assert listmle_loss(scores, lengths).item() == pytest.approx(expected, rel=1e-5)


def test_listmle_prefers_the_true_order():
    lengths = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    right, wrong = torch.log1p(lengths), -torch.log1p(lengths)
    assert listmle_loss(right * 5, lengths) < listmle_loss(wrong * 5, lengths)
    best = min(itertools.permutations(range(5)), key=lambda p: listmle_loss(torch.tensor(p, dtype=torch.float) * 3,
                                                                             lengths).item())
    assert best == (0, 1, 2, 3, 4)


def test_learning_rate_warms_up_linearly_then_decays_to_zero():
    factors = [warmup_then_linear_decay(step, 100, 0.1) for step in range(100)]
    assert factors[:10] == pytest.approx([(step + 1) / 10 for step in range(10)])  # 0.1 ... 1.0
    assert factors[10:] == pytest.approx([(100 - step) / 90 for step in range(10, 100)])  # 1.0 ... 1/90
    assert [warmup_then_linear_decay(step, 4, 0.0) for step in range(4)] == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="warmup_share"):
        FinetuneConfig(warmup_share=1.0)


@pytest.mark.integration
def test_finetuning_with_adapters_moves_the_adapters_and_the_head_and_no_pretrained_weight():
    from predictor.encoder import EncoderConfig, MiniLMEncoder
    from predictor.finetune import RankingNetwork
    from training.finetune_train import fit_network

    torch.set_num_threads(2)
    network = RankingNetwork(MiniLMEncoder(EncoderConfig(head_tokens=4, tail_tokens=8)), lora_rank=2)
    before = {name: tensor.clone() for name, tensor in network.state_dict().items()}
    prompts = [f"<|im_start|>user\nwrite {n} words about rivers<|im_end|>" for n in range(8)]
    fit_network(network, prompts, np.arange(10.0, 90.0, 10.0), FinetuneConfig(list_size=4, warmup_share=0.0))
    moved = {name for name, tensor in network.state_dict().items() if not torch.equal(tensor, before[name])}
    assert any(name.endswith(".lora_b") for name in moved) and any(name.startswith("mlp.") for name in moved)
    assert moved <= set(network.trained_state())  # every pretrained weight as the package has it
    # Continued training keeps the standardisation its head learnt.
    learnt = network.lexical_mean.clone()
    others = [f"<|im_start|>user\nlist {n} colours, one per line<|im_end|>" for n in range(4)]
    fit_network(network, others, np.arange(4.0), FinetuneConfig(list_size=4), standardise=False)
    assert torch.equal(network.lexical_mean, learnt)


def test_a_finetune_with_too_few_rows_for_one_list_is_refused_not_saved_untrained():
    from training.finetune_train import fit_network

    with pytest.raises(ValueError, match="lists of 4 prompts, and 3 train rows make none"):
        fit_network(None, ["a", "b", "c"], np.arange(3.0), FinetuneConfig(list_size=4))


def test_pinball_loss_matches_its_definition():
    predicted, target = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0])
    # under-prediction costs q per unit, over-prediction (1 - q)
    assert pinball_loss(predicted, target, 0.9).item() == pytest.approx((0.9 * 1 + 0.1 * 1) / 2)
    # One side at a time: q and 1 - q would give the same mean above.
    assert pinball_loss(torch.tensor([1.0]), torch.tensor([2.0]), 0.9).item() == pytest.approx(0.9)
    assert pinball_loss(torch.tensor([4.0]), torch.tensor([2.0]), 0.9).item() == pytest.approx(0.2)


def _predictions(scores) -> list[Prediction]:
    return [Prediction(point=float(s) + 1, p50=float(s) + 1, p90=float(s) + 2, score=float(s), rank_len=float(s) + 1)
            for s in scores]


def test_the_dedup_tau_reads_only_prompts_not_in_train(monkeypatch):
    # Rows in train get reversed predictions, the rest exact ones: whole tau < 1, dedup tau 1.
    from types import SimpleNamespace

    from training.labels import LabelledSplit
    from training.train import evaluate_trained

    lengths = np.array([5, 1, 30, 7, 100, 2, 60, 9])
    in_train = np.array([False, True, False, True, False, True, False, False])
    guess = np.where(in_train, 1000 - lengths, lengths)
    split = LabelledSplit([f"p{i}" for i in range(8)], lengths, in_train, np.ones(8, dtype=np.int64),
                          np.zeros(8, dtype=bool))
    trained = SimpleNamespace(valid_predictions=_predictions(guess), test_predictions=_predictions(guess),
                              predictor=SimpleNamespace(spec=PredictorSpec("length", {}, "")))
    metrics = evaluate_trained(SimpleNamespace(valid=split, test=split), trained)
    assert metrics["test_kendall_tau_dedup"] == pytest.approx(1.0)
    # What "in train" means follows what the predictor learned (training/labels.py
    # seen_in_training): trained on the trace, the same rows marked seen, none in ShareGPT's.
    from training import labels as label_data

    unmarked = LabelledSplit(split.prompts, lengths, np.zeros(8, dtype=bool), split.prompt_tokens, split.censored)
    seen_by = {}

    def seen_in_training(data, spec):
        seen_by["labels"] = spec.labels
        return in_train

    monkeypatch.setattr(label_data, "seen_in_training", seen_in_training)
    trained.predictor = SimpleNamespace(spec=PredictorSpec("length", {}, "", labels="trace"))
    metrics = evaluate_trained(SimpleNamespace(valid=unmarked, test=unmarked), trained)
    assert metrics["test_kendall_tau_dedup"] == pytest.approx(1.0) and seen_by["labels"] == "trace"
    assert metrics["test_kendall_tau"] < 0.9


def test_metrics_on_perfect_reversed_and_constant_orders():
    true = np.array([5, 1, 30, 7, 100, 2])
    perfect = metrics.prediction_metrics(true, _predictions(true))
    assert perfect.kendall_tau == pytest.approx(1.0) and perfect.pairwise_accuracy == 1.0
    assert perfect.p90_coverage == 1.0 and perfect.mae_log < 0.7
    assert metrics.prediction_metrics(true, _predictions(-true)).kendall_tau == pytest.approx(-1.0)
    assert metrics.pairwise_accuracy(true.astype(float), np.zeros(6)) == pytest.approx(0.5)


def test_each_metric_by_hand():
    true = np.array([10.0, 20.0, 30.0, 40.0])
    # p50 and p90 equal to some true lengths: coverage counts true <= quantile, boundaries included.
    predictions = [Prediction(point=p, p50=q50, p90=q90, score=-r, rank_len=r) for p, q50, q90, r in
                   [(np.expm1(np.log1p(10.0) + 0.5), 10.0, 20.0, 1.0), (np.expm1(np.log1p(20.0) - 0.5), 15.0, 20.0, 3.0),
                    (30.0, 30.0, 25.0, 2.0), (40.0, 35.0, 40.0, 4.0)]]
    result = metrics.prediction_metrics(true, predictions)
    assert result.p50_coverage == 0.5 and result.p90_coverage == 0.75  # 20 > 15, 40 > 35; 30 > 25
    assert result.mae_log == pytest.approx((0.5 + 0.5 + 0 + 0) / 4)  # an over and an under, not cancelling
    assert result.spearman == pytest.approx(0.8)  # of rank_len (1, 3, 2, 4), not of the score
    assert result.kendall_tau == pytest.approx(4 / 6)


def test_a_reply_cut_at_the_cap_counts_for_calibration_only_where_its_outcome_is_known():
    # The last four replies were cut at 256 tokens before they ended: their true lengths are at
    # least 257, so a quantile at the cap, or a hair under it, misses them.
    true = np.array([10.0, 100.0, 256.0, 256.0, 256.0, 256.0])
    censored = np.array([False, False, True, True, True, True])
    p90 = [20.0, 50.0, 256.0, 300.0, 200.0, 255.999999]  # covers, misses, misses, unknown, misses, misses
    predictions = [Prediction(point=q, p50=q, p90=q, score=q, rank_len=q) for q in p90]
    result = metrics.prediction_metrics(true, predictions, censored)
    # Known covered: 1 of 6; not known uncovered: 2 of 6 (the 300 may cover its reply).
    assert result.p90_coverage == pytest.approx(1 / 6) and result.p90_coverage_max == pytest.approx(2 / 6)
    assert result.num_censored == 4 and result.num_examples == 6
    assert result.mae_log == pytest.approx(np.mean(np.abs(np.log1p([20.0, 50.0]) - np.log1p([10.0, 100.0]))))
    assert metrics.prediction_metrics(true, predictions).p90_coverage == pytest.approx(3 / 6)  # uncensored reading
    assert result.kendall_tau == metrics.prediction_metrics(true, predictions).kendall_tau  # ranking unchanged


def test_trace_labels_mark_replies_cut_at_the_cap():
    from training.labels import load_split

    trace = load_split("test", "trace")
    assert trace.censored.any() and not trace.censored.all()
    assert (trace.lengths[trace.censored] == trace.lengths.max()).all()  # every cut reply sits at the cap
    assert not load_split("validation", "sharegpt").censored.any()


def test_the_primary_tau_is_of_the_ranking_length_the_order_the_scheduler_uses():
    true = np.array([5, 1, 30, 7, 100, 2])
    mixed = [Prediction(point=1.0, p50=256.0, p90=256.0, score=-float(t), rank_len=float(t)) for t in true]
    result = metrics.prediction_metrics(true, mixed)
    assert result.kendall_tau == pytest.approx(1.0) and result.pairwise_accuracy == 1.0
    assert result.kendall_tau_score == pytest.approx(-1.0)


def test_the_tau_interval_brackets_the_tau_and_narrows_with_more_prompts():
    from scipy import stats

    rng = np.random.default_rng(0)
    widths = []
    for n in (100, 2000):
        true = rng.normal(size=n)
        score = true + rng.normal(size=n)  # tau about 0.5
        low, high = metrics.tau_interval(true, score)
        assert low < stats.kendalltau(score, true).statistic < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(20) as wide
    assert metrics.tau_interval([1, 2, 3, 4], [1, 2, 3, 4]) == [1.0, 1.0]
    assert metrics.tau_interval([1, 2], [2, 1]) is None  # too few prompts: JSON null, not NaN


def test_tau_by_bucket_covers_every_row():
    rng = np.random.default_rng(0)
    true = rng.integers(1, 1000, 500)
    bucket_by = rng.integers(1, 2000, 500)
    score = true + rng.normal(0, 100, 500)
    buckets = metrics.tau_by_bucket(true, score, bucket_by)
    assert sum(b.num_examples for b in buckets) == 500
    assert all(b.kendall_tau > 0.5 for b in buckets)
    # Each bucket's tau is of its own rows: reverse the scores in the lowest bucket only.
    lowest = bucket_by < np.quantile(bucket_by, 0.2)
    taus = [b.kendall_tau for b in metrics.tau_by_bucket(true, np.where(lowest, -score, score), bucket_by)]
    assert taus[0] < -0.5 and all(tau > 0.5 for tau in taus[1:])


def test_lambdarank_queries_partition_the_rows():
    y_log = np.log1p(np.arange(1, 150, dtype=float))
    edges = np.quantile(y_log, np.linspace(0, 1, fitters.RELEVANCE_LEVELS + 1)[1:-1])
    order, relevance, sizes = fitters.relevance_and_groups(y_log, edges, seed=0)
    assert sorted(order.tolist()) == list(range(149)) and sizes.sum() == 149
    assert relevance.min() == 0 and relevance.max() == fitters.RELEVANCE_LEVELS - 1
    # relevance grows with the label
    assert np.all(np.diff(relevance[np.argsort(y_log[order])]) >= 0)


def _saved_length_predictor(folder, intercept: float):
    from predictor.length import LengthParams, LengthPredictor
    from predictor.saved import PredictorSpec, save

    spec = PredictorSpec(kind="length", feature_spec={}, data_hash="t")
    return save(LengthPredictor(LengthParams(intercept, 0.1, 0.0, 0.5), spec), folder)


def test_champion_follows_best_validation_tau(tmp_path):
    store = tmp_path / "mlruns"
    with tracking.tracking_session(store):
        runs = {}
        for name, tau, intercept in (("first", 0.2, 1.0), ("better", 0.4, 2.0), ("worse", 0.1, 3.0)):
            folder = _saved_length_predictor(tmp_path / name, intercept)
            runs[name] = tracking.log_run(name, {"model": "length"}, {tracking.SELECTION_METRIC: tau}, folder, [],
                                          tracking.comparison_tags("sharegpt", ""))
            champion = tracking.update_champion()
            assert champion == (runs["first"] if name == "first" else runs["better"])
        # A run whose tau was of another ranking (the score, before runs were tagged) never wins.
        folder = _saved_length_predictor(tmp_path / "old", 4.0)
        tracking.log_run("old", {"model": "length"}, {tracking.SELECTION_METRIC: 0.9}, folder, [],
                         {"tau_of": "score", **tracking.comparison_tags("sharegpt", "")})
        # Nor does a run validated on other labels, or on a split with the trace's prompts held out,
        # or one logged with --no-register (a later registering run must not crown it), or one with
        # only its own validation set's tau (each kind validates on its own number of rows).
        for labels, held_out in (("trace", ""), ("sharegpt", "trace:0123")):
            tracking.log_run("other", {"model": "length"}, {tracking.SELECTION_METRIC: 0.9}, folder, [],
                             tracking.comparison_tags(labels, held_out))
        tracking.log_run("unregistered", {"model": "length"}, {tracking.SELECTION_METRIC: 0.9}, folder, [],
                         tracking.comparison_tags("sharegpt", "", candidate=False))
        tracking.log_run("own rows", {"model": "length"}, {"val_kendall_tau": 0.9}, folder, [],
                         tracking.comparison_tags("sharegpt", ""))
        # Nor one of another feature version (it would not load), nor one that failed.
        tracking.log_run("old features", {"model": "length"}, {tracking.SELECTION_METRIC: 0.9}, folder, [],
                         {**tracking.comparison_tags("sharegpt", ""), "feature_version": "0"})
        import mlflow

        mlflow.start_run(run_name="failed")
        mlflow.set_tags({"feature_version": str(tracking.FEATURE_SPEC_VERSION), "tau_of": tracking.TAU_OF,
                         **tracking.comparison_tags("sharegpt", "")})
        mlflow.log_metric(tracking.SELECTION_METRIC, 0.9)
        mlflow.end_run("FAILED")
        assert tracking.update_champion() == runs["better"]
    local = tracking.download_champion(tmp_path / "download", store=store)
    loaded = predictor.load(local)
    assert loaded.params.intercept == 2.0


def test_a_run_records_whether_its_tracked_files_differed_from_its_commit(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above it counts

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert tracking.git_tags(tmp_path) == {"git_sha": "unknown", "git_dirty": "unknown"}  # no repository
    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("commit", "-qm", "first")
    tags = tracking.git_tags(tmp_path)
    assert len(tags["git_sha"]) == 40 and tags["git_dirty"] == "false"
    (tmp_path / "notes.txt").write_text("untracked files are not the code the run had\n")
    assert tracking.git_tags(tmp_path)["git_dirty"] == "false"
    (tmp_path / "code.py").write_text("a = 2\n")
    assert tracking.git_tags(tmp_path) == {"git_sha": tags["git_sha"], "git_dirty": "true"}


def test_champion_is_chosen_among_runs_on_the_same_turn_table(tmp_path):
    # A run on a rebuilt (e.g. smaller) table scored its tau on other selection rows: a higher
    # tau there must not take the alias from the runs on the table being trained on.
    with tracking.tracking_session(tmp_path / "mlruns"):
        runs = {}
        for name, tau, table in (("current", 0.3, "aaa"), ("other table", 0.9, "bbb")):
            folder = _saved_length_predictor(tmp_path / name, 1.0)
            runs[name] = tracking.log_run(name, {"model": "length"}, {tracking.SELECTION_METRIC: tau}, folder, [],
                                          {"data_hash": table, **tracking.comparison_tags("sharegpt", "")})
        assert tracking.update_champion("aaa") == runs["current"]
        assert tracking.update_champion() == runs["other table"]  # without a table: every run competes


def test_a_rerun_that_only_ties_the_champion_leaves_it_the_champion(tmp_path):
    # The newest of equals won: each rerun of one config moved the alias and made a new version.
    import mlflow

    with tracking.tracking_session(tmp_path / "mlruns"):
        runs = []
        for name in ("first", "rerun", "another rerun"):
            folder = _saved_length_predictor(tmp_path / name, 1.0)
            runs.append(tracking.log_run(name, {"model": "length"}, {tracking.SELECTION_METRIC: 0.4}, folder, [],
                                         tracking.comparison_tags("sharegpt", "")))
            assert tracking.update_champion() == runs[0]
        versions = mlflow.MlflowClient().search_model_versions(f"name='{tracking.MODEL_NAME}'")
        assert [version.run_id for version in versions] == [runs[0]]


def test_download_champion_without_a_store_or_a_registry_raises(tmp_path):
    import sqlite3

    with pytest.raises(LookupError, match="no MLflow store at"):
        tracking.download_champion(store=tmp_path / "empty")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "mlflow.db") as database:  # a database, but no MLflow tables in it
        database.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(LookupError, match="not an MLflow store with a model registry"):
        tracking.download_champion(store=foreign)


def test_download_champion_follows_a_moved_store_and_refuses_an_unreadable_one(tmp_path, monkeypatch):
    # The experiment records its artifact folder as an absolute path: after the store was moved
    # the download failed with an MlflowException traceback (eval-predictor turns only LookupError
    # into its one-line answer), as it did for a file that is no database. And a database without
    # MLflow's tables was given them, by a reader that claims to write nothing.
    import shutil
    import sqlite3

    store = tmp_path / "mlruns"
    with tracking.tracking_session(store):
        folder = _saved_length_predictor(tmp_path / "run", 2.5)
        tracking.log_run("run", {"model": "length"}, {tracking.SELECTION_METRIC: 0.3}, folder, [],
                         tracking.comparison_tags("sharegpt", ""))
        tracking.update_champion()
    moved = tmp_path / "moved" / "mlruns"
    shutil.move(store, moved)
    assert predictor.load(tracking.download_champion(tmp_path / "download", store=moved)).params.intercept == 2.5
    shutil.rmtree(moved / "artifacts")
    with pytest.raises(tracking.ChampionFilesMissing, match="files are missing"):
        tracking.download_champion(tmp_path / "again", store=moved)
    # eval-predictor does not evaluate the default in the missing champion's place.
    from training import evaluate

    monkeypatch.setattr(tracking, "default_store", lambda: moved)
    with pytest.raises(ValueError, match="--predictor champion: the champion's files are missing"):
        evaluate.resolve_predictor("champion", None)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "mlflow.db").write_text("not a database")
    with pytest.raises(LookupError, match="not an MLflow store"):
        tracking.download_champion(store=garbage)
    other = tmp_path / "other"
    other.mkdir()
    with sqlite3.connect(other / "mlflow.db") as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(LookupError, match="not an MLflow store"):
        tracking.download_champion(store=other)
    with sqlite3.connect(other / "mlflow.db") as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert tables == ["notes"]
    # An empty file is no store yet (MLflow initialises one there); a locked one is not called foreign.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "mlflow.db").write_bytes(b"")
    with pytest.raises(LookupError, match="no MLflow store"):
        tracking.download_champion(store=empty)
    tracking.check_store(empty)
    locker = sqlite3.connect(moved / "mlflow.db", timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(OSError, match="locked"):
            tracking.check_store(moved)
    finally:
        locker.rollback()
        locker.close()


def test_eval_predictor_champion_falls_back_to_the_default_only_in_the_repositorys_own_store(
        tmp_path, monkeypatch, capsys):
    from engine.config import DEFAULT_PREDICTOR
    from training import evaluate

    monkeypatch.setattr(tracking, "default_store", lambda: tmp_path / "fresh-clone")
    assert evaluate.resolve_predictor("champion", None) == DEFAULT_PREDICTOR
    assert f"evaluating {DEFAULT_PREDICTOR}" in capsys.readouterr().err
    # A store the caller named must hold a champion: a typo there is no reason to score another model.
    with pytest.raises(ValueError, match="--predictor champion: no MLflow store at"):
        evaluate.resolve_predictor("champion", tmp_path / "typo")


def test_saving_replaces_a_predictor_folder_or_a_symlink_to_one_whole(tmp_path):
    from training.train import replace_folder

    new = tmp_path / "new"
    new.mkdir()
    (new / "predictor.json").write_text("new")
    old = tmp_path / "old"
    (old / "prior").mkdir(parents=True)
    (old / "predictor.json").write_text("old")
    link = tmp_path / "link"
    link.symlink_to(old)
    replace_folder(new, link)  # before, rmtree refused the symlink and copytree then failed
    assert not link.is_symlink() and (link / "predictor.json").read_text() == "new"
    assert (old / "prior").exists()  # the folder the link pointed at is left alone
    replace_folder(new, old)
    assert sorted(p.name for p in old.iterdir()) == ["predictor.json"]
    assert not list(tmp_path.glob(".*partial"))


def test_train_refuses_to_save_over_a_folder_that_is_not_a_predictor(tmp_path):
    from training import train

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    args = argparse.Namespace(model="lexical", labels="sharegpt", max_train=10, max_eval=10, store=tmp_path / "mlruns",
                              save=tmp_path / "notes", no_register=True, seed=0, prior=None, hold_out_trace=False,
                              lora_rank=None, probe_tokens=None)
    with pytest.raises(ValueError, match="not a predictor folder"):
        train.train_and_log(args)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


@pytest.mark.integration
def test_tiny_training_run_registers_a_loadable_champion(tmp_path, capsys):
    from training import evaluate, train

    args = argparse.Namespace(model="lexical", labels="sharegpt", max_train=600, max_eval=300, store=tmp_path / "mlruns",
                              save=tmp_path / "saved", no_register=False, seed=0, prior=None, hold_out_trace=False,
                              lora_rank=None, probe_tokens=None)
    (tmp_path / "saved" / "prior").mkdir(parents=True)  # left by an earlier stacked model saved there
    (tmp_path / "saved" / "predictor.json").write_text("{}")
    run_id, logged = train.train_and_log(args)
    assert not (tmp_path / "saved" / "prior").exists()  # replaced whole, or it would load as stacked
    assert -1 <= logged["val_kendall_tau"] <= 1 and logged["test_num_examples"] == 300
    # Scored for champion on the fixed selection rows, not on its own 300.
    assert logged[tracking.SELECTION_METRIC] != logged["val_kendall_tau"]
    assert logged[tracking.SELECTION_METRIC] > 0.2
    spec = json.loads((tmp_path / "saved" / "predictor.json").read_text())
    assert spec["kind"] == "lexical" and "held_out" not in spec  # readable by code older than the field
    path = evaluate.resolve_predictor("champion", tmp_path / "mlruns")
    report = evaluate.evaluate(path, limit=200, measure_latency=False)
    assert report.num_examples == 200 and report.kind == "lexical"
    # Each dedup drops exactly its rows of the same seeded subsample.
    from training import labels as label_data

    test = label_data.subsample(label_data.load_split("test"), 200, seed=2)
    strict = ~test.in_train & ~label_data.last_message_in_train(test.prompts)
    assert report.num_examples_dedup == int((~test.in_train).sum()) < 200
    assert report.num_examples_dedup_last_message == int(strict.sum()) < report.num_examples_dedup
    json.dumps(dataclasses.asdict(report), allow_nan=False)  # --no-latency writes null, not NaN
    # the registered folder predicts exactly what the locally saved copy predicts
    prompts = ["<|im_start|>user\nwrite an essay<|im_end|>\n<|im_start|>assistant\n"]
    assert predictor.load(path).predict(prompts) == predictor.load(tmp_path / "saved").predict(prompts)
    # --no-register: logged, tagged out of the selection, and the champion stays.
    unregistered, unscored = train.train_and_log(argparse.Namespace(**{**vars(args), "no_register": True,
                                                                       "save": None}))
    assert tracking.SELECTION_METRIC not in unscored  # it never competes, so its rows are not scored
    import mlflow

    with tracking.tracking_session(tmp_path / "mlruns"):
        assert mlflow.get_run(unregistered).data.tags["candidate"] == "false"
        assert tracking.best_run_id() == run_id


@pytest.mark.integration
def test_trace_records_lengths_and_resumes(tmp_path):
    from engine.llm import LLM
    from training import dataset, trace

    if not (dataset.CONVERTED_MODEL_DIR / "config.json").exists():
        pytest.skip("converted model missing (make model)")
    rows = [{"key": trace.prompt_key(p), "conversation_id": f"c{i}", "turn_index": 0, "prompt": p,
             "prompt_tokens": 30, "split": split, "in_train": False}
            for i, (p, split) in enumerate([
                ("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", "train"),
                ("<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n", "test")])]
    llm = LLM(model=str(dataset.CONVERTED_MODEL_DIR))
    log = tmp_path / "trace.jsonl"
    assert trace.record_trace(llm, rows[:1], log, max_tokens=6, temperature=1.0, window=2, seed=0) == 1
    with log.open("a") as cut:  # a run killed in the middle of writing a line
        cut.write('{"key": "0123456789abcdef", "output_tok')
    assert trace.record_trace(llm, rows, log, max_tokens=6, temperature=1.0, window=2, seed=0) == 1
    assert trace.record_trace(llm, rows, log, max_tokens=6, temperature=1.0, window=2, seed=0) == 0
    for other in ({"max_tokens": 8}, {"temperature": 0.5}, {"seed": 1}):  # not mixed into one trace
        settings = {"max_tokens": 6, "temperature": 1.0, "seed": 0, **other}
        with pytest.raises(ValueError, match=f"sampled with {next(iter(other))}"):
            trace.record_trace(llm, rows, log, window=2, **settings)
    assert trace.write_trace_table(log, tmp_path / "trace.parquet") == 2
    assert len(log.read_text().splitlines()) == 2
    table = trace.load_trace(path=tmp_path / "trace.parquet")
    assert sorted(table["conversation_id"]) == ["c0", "c1"]
    assert all(1 <= n <= 6 for n in table["output_tokens"])
    assert set(table["finish_reason"]) <= {"stop", "length"}
    assert trace.load_trace("test", path=tmp_path / "trace.parquet")["conversation_id"] == ["c1"]


def test_a_trace_run_that_adds_nothing_leaves_the_table_as_it_is(tmp_path):
    # A legacy-format table (no settings columns, as the committed trace) was rewritten by a run
    # that traced nothing: the same rows, a changed committed file.
    from training import trace

    table, log = tmp_path / "trace.parquet", tmp_path / "trace.jsonl"
    _legacy_trace_table(table, lengths=(5,))
    before = table.read_bytes()
    assert trace.seed_log_from_table(log, table) == 1
    assert trace.write_trace_table(log, table) == 1 and table.read_bytes() == before
    with log.open("a") as more:  # a new row is written, with the settings columns
        row = {**trace.read_log(log)[0], "key": "k1", "max_tokens": 256, "temperature": 1.0, "seed": 3}
        more.write(json.dumps(row) + "\n")
    assert trace.write_trace_table(log, table) == 2
    assert trace.load_trace(path=table)["seed"] == [None, 3]


def test_a_log_without_settings_shows_its_cap_through_rows_cut_at_it():
    # Rows copied from a committed table carry no settings; one that stopped at the cap names it.
    from training.trace import check_resume_settings

    rows = [{"key": "a", "output_tokens": 256, "finish_reason": "length"},
            {"key": "b", "output_tokens": 40, "finish_reason": "stop"}]
    check_resume_settings(rows, max_tokens=256, temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="cut at 256 tokens, this run asks --max-tokens 512"):
        check_resume_settings(rows, max_tokens=512, temperature=1.0, seed=0)
    check_resume_settings(rows[1:], max_tokens=512, temperature=1.0, seed=0)  # nothing says otherwise


class RecordingEngine:
    """An engine that finishes every request at its next step, with two tokens, noting each seed."""

    def __init__(self):
        self.seeds, self.live = {}, []

    def add_request(self, request_id, prompt, params):
        self.seeds[request_id] = params.seed
        self.live.append(request_id)

    def step(self):
        from types import SimpleNamespace

        done, self.live = self.live, []
        return [SimpleNamespace(request_id=r, finished=True, token_ids=(1, 2), finish_reason="stop") for r in done]


def two_trace_rows() -> list[dict]:
    from training import trace

    return [{"key": trace.prompt_key(p), "conversation_id": f"c{i}", "turn_index": 0, "prompt": p, "prompt_tokens": 3,
             "split": "test", "in_train": False} for i, p in enumerate(["first prompt", "second prompt"])]


def test_each_prompt_draws_with_a_seed_of_its_key_and_the_run_seed(tmp_path):
    # A resample (--seed 1) must draw other samples than the committed trace (--seed 0): with the
    # run seed ignored, its two-sample agreement would be about 1 and the ceiling meaningless.
    from types import SimpleNamespace

    from training import trace

    rows = two_trace_rows()
    seeds = []
    for run_seed in (0, 1):
        engine = RecordingEngine()
        trace.record_trace(SimpleNamespace(engine=engine), rows, tmp_path / f"log{run_seed}.jsonl", max_tokens=4,
                           temperature=1.0, window=2, seed=run_seed)
        seeds.append([engine.seeds[f"trace-{row['key']}"] for row in rows])
        assert seeds[-1] == [trace.seed_of(row["key"], run_seed) for row in rows]
    assert seeds[0][0] != seeds[0][1]  # each prompt its own seed
    assert all(a != b for a, b in zip(*seeds))  # and another one in a resample with another seed


def test_a_trace_resumes_only_under_the_prompt_budget_it_was_drawn_with(tmp_path):
    # Another budget permutes other candidates: resumed under it, a trace stopped being one
    # random sample (the first rows from one order, the rest from another) and nothing said so.
    from types import SimpleNamespace

    from training import trace

    rows = two_trace_rows()
    llm, log, table = SimpleNamespace(engine=RecordingEngine()), tmp_path / "trace.jsonl", tmp_path / "trace.parquet"
    settings = {"max_tokens": 4, "temperature": 1.0, "window": 2, "seed": 0}
    assert trace.record_trace(llm, rows[:1], log, max_prompt_tokens=300, **settings) == 1
    with pytest.raises(ValueError, match="at most 300 tokens, this run draws from those of at most 200"):
        trace.record_trace(llm, rows, log, max_prompt_tokens=200, **settings)
    assert trace.record_trace(llm, rows, log, max_prompt_tokens=300, **settings) == 1
    assert trace.record_trace(llm, rows, log, max_prompt_tokens=None, **settings) == 0  # a resample's: unchecked
    # The budget rides through the table into a fresh clone's log.
    trace.write_trace_table(log, table)
    assert trace.load_trace(path=table)["max_prompt_tokens"] == [300, 300]
    fresh = tmp_path / "fresh.jsonl"
    trace.seed_log_from_table(fresh, table)
    with pytest.raises(ValueError, match="at most 300 tokens"):
        trace.check_resume_settings(trace.read_log(fresh), max_tokens=4, temperature=1.0, seed=0, max_prompt_tokens=200)
    # The committed trace (no settings columns) was drawn under 384, and says so.
    legacy, legacy_log = tmp_path / "legacy.parquet", tmp_path / "legacy.jsonl"
    _legacy_trace_table(legacy)
    trace.seed_log_from_table(legacy_log, legacy)
    records = trace.read_log(legacy_log)
    trace.check_resume_settings(records, max_tokens=256, temperature=1.0, seed=0, max_prompt_tokens=384)
    with pytest.raises(ValueError, match="at most 384 tokens"):
        trace.check_resume_settings(records, max_tokens=256, temperature=1.0, seed=0, max_prompt_tokens=512)


def test_a_table_with_settings_columns_but_no_prompt_budget_reads_it_as_unknown(tmp_path):
    # Tables written between sessions 20 and 32 hold max_tokens, temperature and seed only.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training import trace

    row = {"key": "k0", "conversation_id": "c0", "turn_index": 0, "prompt": "p0", "prompt_tokens": 5,
           "output_tokens": 7, "finish_reason": "stop", "split": "test", "in_train": False,
           "max_tokens": 256, "temperature": 1.0, "seed": 2}
    table = tmp_path / "trace.parquet"
    pq.write_table(pa.Table.from_pylist([row]), table)
    log = tmp_path / "trace.jsonl"
    assert trace.seed_log_from_table(log, table) == 1
    record = trace.read_log(log)[0]
    assert record["seed"] == 2 and "max_prompt_tokens" not in record
    trace.check_resume_settings([record], max_tokens=256, temperature=1.0, seed=2, max_prompt_tokens=100)


def test_sample_agreement_pairs_prompts_by_key(tmp_path):
    from training import trace

    def table(name, lengths):
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps({
            "key": f"k{i}", "conversation_id": f"c{i}", "turn_index": 0, "prompt": f"p{i}", "prompt_tokens": 5,
            "output_tokens": n, "finish_reason": "stop", "split": "test", "in_train": False}) + "\n"
            for i, n in lengths))
        trace.write_trace_table(log, tmp_path / f"{name}.parquet")
        return tmp_path / f"{name}.parquet"

    first = table("a", [(0, 10), (1, 20), (2, 30), (3, 40)])
    same_order = table("b", [(3, 400), (2, 300), (0, 100), (1, 200)])  # other order, same ranking
    reversed_order = table("c", [(0, 4), (1, 3), (2, 2), (9, 1)])  # k9 has no partner
    agree, disagree = trace.sample_agreement(first, same_order), trace.sample_agreement(first, reversed_order)
    assert (agree["num_prompts"], agree["kendall_tau_two_samples"]) == (4, 1.0)
    assert (disagree["num_prompts"], disagree["kendall_tau_two_samples"]) == (3, -1.0)
    assert agree["kendall_tau_ceiling_estimate"] > disagree["kendall_tau_ceiling_estimate"]


def test_a_second_sample_scores_the_ranking_alone_and_in_the_mean_of_both(tmp_path):
    from scipy import stats

    from training import trace
    from training.evaluate import second_sample_figures

    prompts = [f"prompt {i}" for i in range(5)]
    log = tmp_path / "again.jsonl"
    # The second sample reverses the ranking of the first four prompts; the fifth was not resampled.
    again = {0: 40, 1: 30, 2: 20, 3: 10}
    log.write_text("".join(json.dumps({
        "key": trace.prompt_key(prompts[i]), "conversation_id": f"c{i}", "turn_index": 0, "prompt": prompts[i],
        "prompt_tokens": 5, "output_tokens": n, "finish_reason": "stop", "split": "test", "in_train": False}) + "\n"
        for i, n in again.items()))
    trace.write_trace_table(log, tmp_path / "again.parquet")
    first = np.asarray([10, 20, 30, 100, 50])
    ranked = [Prediction(point=n, p50=n, p90=n, score=n, rank_len=n) for n in (1.0, 2.0, 3.0, 4.0, 5.0)]
    figures = second_sample_figures(prompts, first, ranked, tmp_path / "again.parquet")
    assert figures["num_examples_resampled"] == 4
    assert figures["kendall_tau_second_sample"] == pytest.approx(-1.0)
    # Means 25, 25, 25, 55: three ties, then the longest last.
    expected = stats.kendalltau([1, 2, 3, 4], [25, 25, 25, 55]).statistic
    assert figures["kendall_tau_two_sample_mean"] == pytest.approx(expected) and expected > 0
    # The prompt left out may sit anywhere: each second sample meets its own prompt's prediction.
    moved = second_sample_figures(prompts[4:] + prompts[:4], np.roll(first, 1), ranked[4:] + ranked[:4],
                                  tmp_path / "again.parquet")
    assert moved == figures


def test_a_fresh_clone_extends_the_committed_trace_table_instead_of_replacing_it(tmp_path, monkeypatch):
    # The log is git-ignored, the table committed: a clone has the table and no log. Before, a run
    # there traced every prompt again and rewrote the table from its new log alone.
    from training import dataset, trace

    log, table = tmp_path / "trace.jsonl", tmp_path / "trace.parquet"
    log.write_text("".join(json.dumps({
        "key": f"k{i}", "conversation_id": f"c{i}", "turn_index": 0, "prompt": f"p{i}", "prompt_tokens": 5,
        "output_tokens": 10 + i, "finish_reason": "stop", "split": "test", "in_train": False}) + "\n"
        for i in range(3)))
    trace.write_trace_table(log, table)
    log.unlink()
    assert trace.seed_log_from_table(log, table) == 3
    assert trace.seed_log_from_table(log, table) == 0  # nothing twice
    assert {r["key"] for r in trace.read_log(log)} == {"k0", "k1", "k2"}
    assert trace.write_trace_table(log, table) == 3
    assert trace.load_trace(path=table)["output_tokens"] == [10, 11, 12]
    # The committed trace is protected however its path is spelled.
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    monkeypatch.chdir(dataset.REPO_ROOT)
    relative = str(trace.DEFAULT_TRACE.relative_to(dataset.REPO_ROOT))
    with pytest.raises(ValueError, match="its own --log and --out"):
        trace.run(parser.parse_args(["--num-prompts", "5", "--resample-split", "test", "--out", relative,
                                     "--log", str(tmp_path / "other.jsonl")]))


def _legacy_trace_table(path, lengths=(10, 11)) -> None:
    """A trace table as written before its rows carried their sampling settings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training import trace

    rows = [{"key": f"k{i}", "conversation_id": f"c{i}", "turn_index": 0, "prompt": f"p{i}", "prompt_tokens": 5,
             "output_tokens": n, "finish_reason": "stop", "split": "test", "in_train": False}
            for i, n in enumerate(lengths)]
    pq.write_table(pa.table({name: [row[name] for row in rows] for name in trace.TRACE_COLUMNS}), path)


def test_a_trace_table_keeps_its_settings_and_a_legacy_one_is_read_at_the_committed_defaults(tmp_path):
    # Before, rows copied from a table came without settings, so a clone could extend the committed
    # trace at another temperature unchecked.
    from training import trace

    legacy, log = tmp_path / "legacy.parquet", tmp_path / "trace.jsonl"
    _legacy_trace_table(legacy)
    assert trace.seed_log_from_table(log, legacy) == 2
    records = trace.read_log(log)
    with pytest.raises(ValueError, match="sampled with temperature 1.0"):
        trace.check_resume_settings(records, max_tokens=256, temperature=0.5, seed=0)
    with pytest.raises(ValueError, match="sampled with max_tokens 256"):
        trace.check_resume_settings(records, max_tokens=128, temperature=1.0, seed=3)
    trace.check_resume_settings(records, max_tokens=256, temperature=1.0, seed=3)  # the seed is unknown
    assert trace.trace_seeds(legacy) == {trace.LEGACY_TRACE_SEED}
    # Written again, the table carries the settings, and a fresh log copied from it has them.
    with log.open("a") as more:
        more.write(json.dumps({**records[0], "key": "k9", "max_tokens": 256, "temperature": 1.0, "seed": 4}) + "\n")
    table = tmp_path / "trace.parquet"
    assert trace.write_trace_table(log, table) == 3
    fresh = tmp_path / "fresh.jsonl"
    trace.seed_log_from_table(fresh, table)
    assert [(r.get("temperature"), r.get("seed")) for r in trace.read_log(fresh)] == [(1.0, None), (1.0, None),
                                                                                       (1.0, 4)]
    assert trace.trace_seeds(table) == {4}


def test_a_resample_may_not_redraw_the_traces_own_seeds(tmp_path):
    from training import trace

    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    with pytest.raises(ValueError, match="a seed the trace was drawn with"):
        trace.run(parser.parse_args(["--num-prompts", "5", "--resample-split", "test", "--out",
                                     str(tmp_path / "again.parquet"), "--log", str(tmp_path / "again.jsonl")]))


def test_a_whole_last_log_line_without_its_line_break_is_kept_and_ended(tmp_path):
    from training import trace

    log = tmp_path / "trace.jsonl"
    log.write_text('{"key": "a"}\n{"key": "b"}')  # killed between the record and its line break
    trace.trim_partial_line(log)
    assert log.read_text() == '{"key": "a"}\n{"key": "b"}\n'
    log.write_text('{"key": "a"}\n{"key": "b", "outp')  # killed inside the record
    trace.trim_partial_line(log)
    assert log.read_text() == '{"key": "a"}\n'


def test_tables_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from training import data_prepare, dataset, trace

    table = tmp_path / "trace.parquet"
    _legacy_trace_table(table)
    log = tmp_path / "trace.jsonl"
    trace.seed_log_from_table(log, table)
    with log.open("a") as more:  # a row the table lacks: the table is rewritten
        more.write(json.dumps({**trace.read_log(log)[0], "key": "k2", "output_tokens": 12}) + "\n")
    real_write = pq.write_table

    def interrupted(data, where, **kwargs):
        real_write(data.slice(0, 1), where, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C as the file is being written

    monkeypatch.setattr(pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trace.write_trace_table(log, table)
    assert trace.load_trace(path=table)["output_tokens"] == [10, 11]
    # The turn table: an interrupt while any split is written leaves every split as it was.
    columns = data_prepare.TurnColumns()
    for i, split in enumerate(("train", "validation", "test")):
        for name, value in {"conversation_id": f"c{i}", "turn_index": 0,
                            "prompt": f"p{i}", "prompt_tokens": 3, "response_tokens": 4, "split": split,
                            "in_train": False}.items():
            getattr(columns, name).append(value)
    monkeypatch.setattr(pq, "write_table", real_write)
    turns = tmp_path / "turns"
    data_prepare.write_table(columns, turns)
    before = {name: (turns / f"{name}.parquet").read_bytes() for name in dataset.SPLITS}
    calls = []

    def fails_on_the_second(data, where, **kwargs):
        calls.append(where)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_write(data, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", fails_on_the_second)
    columns.prompt_tokens = [9, 9, 9]
    with pytest.raises(KeyboardInterrupt):
        data_prepare.write_table(columns, turns)
    assert {name: (turns / f"{name}.parquet").read_bytes() for name in dataset.SPLITS} == before


def test_a_table_rewritten_under_its_old_modification_time_loads_its_new_rows(tmp_path):
    # datasets knows a local file by path and mtime; the cache is keyed by content as well.
    import os

    from training import trace

    table = tmp_path / "trace.parquet"
    _legacy_trace_table(table, lengths=(10, 11))
    assert trace.load_trace(path=table)["output_tokens"] == [10, 11]
    stamp = os.stat(table).st_mtime_ns
    _legacy_trace_table(table, lengths=(20, 21))
    os.utime(table, ns=(stamp, stamp))
    assert trace.load_trace(path=table)["output_tokens"] == [20, 21]


def test_trace_agreement_needs_an_existing_table(tmp_path):
    from training import trace

    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    with pytest.raises(ValueError, match="no trace table"):
        trace.run(parser.parse_args(["--agreement", str(tmp_path / "missing.parquet")]))
    with pytest.raises(ValueError, match="--num-prompts"):
        trace.run(parser.parse_args([]))
    for bad in (["--num-prompts", "0"], ["--max-tokens", "-1"], ["--window", "0"], ["--temperature", "-0.5"]):
        with pytest.raises(SystemExit):  # argparse's one-line usage error
            parser.parse_args(bad)


@pytest.mark.integration
def test_held_out_conversations_and_prompts_leave_train_and_validation():
    from training import dataset, labels
    from training.trace import load_trace, prompt_key

    trace = load_trace()
    conversations, keys = set(trace["conversation_id"]), set(trace["key"])
    held_out = labels.trace_held_out()
    for split in ("train", "validation"):
        turns = dataset.load_turns(split)
        outside = [c not in conversations for c in turns["conversation_id"]]
        kept = [o and prompt_key(p) not in keys for o, p in zip(outside, turns["prompt"])]
        # The trace drew prompts from every split, and ShareGPT repeats some of them ("hi") in
        # conversations the trace never touched: those copies go too.
        assert sum(kept) < sum(outside) < len(turns)
        assert len(labels.load_split(split, "sharegpt", held_out)) == sum(kept)
    from training import train

    data = train.load_data("sharegpt", "lexical", None, 100, hold_out_trace=True)
    assert data.held_out == labels.trace_held_out_tag() and len(data.test) == 100  # test rows stay


@pytest.mark.integration
def test_a_held_out_models_seen_test_prompts_are_those_its_training_rows_hold():
    from predictor.saved import PredictorSpec
    from training import labels

    spec = PredictorSpec("length", {}, "h", labels="sharegpt", held_out=labels.trace_held_out_tag())
    test = labels.load_split("test")
    trained_on = set(labels.load_split("train", "sharegpt", labels.trace_held_out()).prompts)
    seen = labels.seen_in_training(test, spec)
    assert seen.tolist() == [p in trained_on for p in test.prompts]
    # Test prompts whose train copies all lie in conversations the trace drew from: in the train
    # split, but not learned.
    assert (test.in_train & ~seen).sum() > 100
    last = labels.last_message_seen_in_training(test, spec)
    assert (last >= seen).all() and not last.all()


def test_a_prior_must_have_been_trained_without_the_traces_conversations(tmp_path):
    from predictor.heads import LgbmHeads
    from predictor.saved import PredictorSpec, write_spec
    from training.labels import trace_held_out_tag
    from training.train_models import _load_prior

    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 3))
    lengths = np.exp(features[:, 0] + 3).astype(int) + 1
    config = fitters.LgbmConfig(num_leaves=4, max_rounds=5, early_stopping_rounds=2, min_data_in_leaf=5, num_threads=1)
    fitters.fit_lgbm_heads(features, lengths, features, lengths, config).save(tmp_path)
    feature_spec = {"names": ["a", "b", "c"]}
    for held_out, labels in (("", "trace"), ("trace:0123456789abcdef", "trace"), (trace_held_out_tag(), "sharegpt")):
        write_spec(tmp_path, PredictorSpec("embed_lgbm", feature_spec, "h", held_out=held_out))
        with pytest.raises(ValueError, match="without the trace's conversations"):
            _load_prior(tmp_path, feature_spec, labels)
    write_spec(tmp_path, PredictorSpec("embed_lgbm", feature_spec, "h", held_out=trace_held_out_tag()))
    heads, spec = _load_prior(tmp_path, feature_spec, "trace")
    assert isinstance(heads, LgbmHeads) and spec.held_out == trace_held_out_tag()


def test_a_bad_prior_is_refused_before_the_encoder_loads(monkeypatch):
    import predictor.encoder
    from training.labels import LabelledSplit
    from training.train_models import TrainingData, train_embed_lgbm

    def no_encoder(*args, **kwargs):
        raise AssertionError("the encoder was loaded before the prior was checked")

    monkeypatch.setattr(predictor.encoder, "MiniLMEncoder", no_encoder)
    empty = LabelledSplit([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64),
                          np.zeros(0, dtype=bool))
    data = TrainingData(empty, empty, empty, labels="trace", data_hash="", prior=tracking.REPO_ROOT / "data" /
                        "predictors" / "default")  # trained on every trace train prompt
    with pytest.raises(ValueError, match="hold-out-trace"):
        train_embed_lgbm(data, fitters.LgbmConfig())


def test_subsample_is_a_seeded_random_subset_not_the_first_rows():
    from training.labels import LabelledSplit, subsample

    split = LabelledSplit([f"p{i}" for i in range(100)], np.arange(100), np.zeros(100, dtype=bool),
                          np.ones(100, dtype=np.int64), np.arange(100) % 3 == 0)
    picked = subsample(split, 10, seed=2)
    assert picked.prompts == subsample(split, 10, seed=2).prompts  # seeded
    assert picked.prompts != split.prompts[:10] and picked.lengths.tolist() == sorted(picked.lengths.tolist())
    assert subsample(split, 10, seed=3).prompts != picked.prompts and subsample(split, None, seed=2) is split
    assert picked.censored.tolist() == [length % 3 == 0 for length in picked.lengths]  # rows stay whole


def test_trace_candidates_are_each_distinct_fitting_prompt_once_in_a_seeded_order(monkeypatch):
    import datasets

    from training import dataset, trace

    prompts = ["hi", "hi", "write an essay", "continue", "hi", "a prompt far too long", "continue"]
    table = datasets.Dataset.from_dict({
        "conversation_id": [f"c{i}" for i in range(7)], "turn_index": [0] * 7, "prompt": prompts,
        "prompt_tokens": [1, 1, 3, 1, 1, 500, 1], "split": ["train"] * 7, "in_train": [False] * 7})
    monkeypatch.setattr(dataset, "load_turns", lambda split=None: table)
    rows = trace.candidate_rows(max_prompt_tokens=10, seed=0)
    assert sorted(row["prompt"] for row in rows) == ["continue", "hi", "write an essay"]
    assert len({row["key"] for row in rows}) == 3
    assert [row["key"] for row in trace.candidate_rows(10, seed=0)] == [row["key"] for row in rows]


def test_coverage_of_rows_of_unknown_outcome_spans_zero_to_one() -> None:
    # The only reply was cut at the cap and the quantile reaches past it: unknown, not covered.
    assert metrics.coverage(np.array([256.0]), np.array([300.0]), np.array([True])) == (0.0, 1.0)
    assert all(np.isnan(metrics.coverage(np.array([]), np.array([]), np.array([], dtype=bool))))


def test_mae_log_reads_a_negative_point_as_zero() -> None:
    predictions = [Prediction(point=-0.5, p50=1.0, p90=2.0, score=0.0, rank_len=1.0),
                   Prediction(point=1.0, p50=1.0, p90=2.0, score=1.0, rank_len=2.0)]
    assert metrics.prediction_metrics([0, 1], predictions).mae_log == pytest.approx(0.0)


def test_latency_per_prompt_is_the_median_call_time_over_the_batch_it_timed(monkeypatch):
    # A fake clock: each predict() costs 2 ms per prompt plus 10 ms per call, so a batch of 32
    # reads 2.3125 ms per prompt, and a batch larger than the prompts there are times what there is.
    from training import evaluate

    clock = {"now": 0.0}
    sizes = []

    class Model:
        def predict(self, batch):
            sizes.append(len(batch))
            clock["now"] += 0.002 * len(batch) + 0.010

    monkeypatch.setattr(evaluate.time, "perf_counter", lambda: clock["now"])
    prompts = [f"p{i}" for i in range(40)]
    assert evaluate.latency_ms_per_prompt(Model(), prompts, 32, calls=5) == pytest.approx(2.3125)
    assert sizes == [32] * 6  # a warm-up call, then the five timed
    sizes.clear()
    assert evaluate.latency_ms_per_prompt(Model(), prompts[:8], 32, calls=3) == pytest.approx(2.0 + 10.0 / 8)
    assert sizes == [8] * 4


def test_latency_per_prompt_is_a_median_that_one_stalled_call_leaves_alone(monkeypatch):
    from training import evaluate

    clock = {"now": 0.0, "calls": 0}

    class Model:
        def predict(self, batch):
            clock["calls"] += 1
            clock["now"] += 0.001 * len(batch) + (1.0 if clock["calls"] == 3 else 0.0)  # one 1 s stall

    monkeypatch.setattr(evaluate.time, "perf_counter", lambda: clock["now"])
    assert evaluate.latency_ms_per_prompt(Model(), [f"p{i}" for i in range(8)], 1, calls=5) == pytest.approx(1.0)


def test_eval_predictor_champion_without_a_default_predictor_says_how_to_get_one(tmp_path, monkeypatch):
    from training import evaluate

    monkeypatch.setattr(tracking, "default_store", lambda: tmp_path / "fresh-clone")
    monkeypatch.setattr(evaluate, "DEFAULT_PREDICTOR", tmp_path / "no-default")
    with pytest.raises(ValueError, match="train one with `lengthwise train`"):
        evaluate.resolve_predictor("champion", None)


def test_a_quantile_at_the_cap_plus_one_leaves_a_cut_reply_unknown():
    # A reply cut at 256 has a true length of at least 257: a p90 of 257 may cover it, 256.5 cannot.
    true = np.array([10.0, 256.0, 256.0])
    censored = np.array([False, True, True])
    assert metrics.coverage(true, np.array([20.0, 257.0, 256.5]), censored) == pytest.approx((1 / 3, 2 / 3))


def test_coverage_of_cut_replies_is_bounded_over_every_row_not_read_over_the_known_ones():
    # Half the replies cut at 256. Leaving the unknown rows out, a p90 just past the cap read
    # 1.000 whatever it covered: every cut reply unknown, every uncut one below it.
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(5.5, 1.0, 4000))
    cut = lengths > 256
    recorded = np.where(cut, 256.0, np.floor(lengths))
    low, high = metrics.coverage(recorded, np.full(len(lengths), 257.0), cut)
    true_share = np.mean(lengths <= 257.0)
    assert low <= true_share <= high and low < 0.6 and high == 1.0
    exact = np.quantile(lengths, 0.9)  # a calibrated p90, far past the cap: only bounds are known
    low, high = metrics.coverage(recorded, np.full(len(lengths), exact), cut)
    assert low <= 0.9 <= high


def test_a_trace_tables_settings_come_back_as_they_were_logged(tmp_path):
    from training import trace

    row = {"key": "k0", "conversation_id": "c0", "turn_index": 0, "prompt": "p0", "prompt_tokens": 5,
           "output_tokens": 128, "finish_reason": "length", "split": "test", "in_train": False}
    log, table, fresh = tmp_path / "trace.jsonl", tmp_path / "trace.parquet", tmp_path / "fresh.jsonl"
    # A temperature float32 cannot hold, and a row logged before the settings were (cap unknown).
    log.write_text(json.dumps({**row, "max_tokens": 128, "temperature": 0.7, "seed": 3}) + "\n"
                   + json.dumps({**row, "key": "k1"}) + "\n")
    trace.write_trace_table(log, table)
    trace.seed_log_from_table(fresh, table)
    records = trace.read_log(fresh)
    assert records[0]["temperature"] == 0.7 and "max_tokens" not in records[1]
    trace.check_resume_settings(records, max_tokens=128, temperature=0.7, seed=3)
    with pytest.raises(ValueError, match="cut at 128 tokens"):  # the unknown cap is still checked
        trace.check_resume_settings(records[1:], max_tokens=256, temperature=0.7, seed=3)
    assert trace.trace_seeds(tmp_path / "none.parquet") == set()  # no trace: no seed to avoid


def test_a_plain_trace_run_may_use_the_traces_own_seed(tmp_path):
    # Only a resample is barred from the trace's seeds: extending the trace draws with them.
    from training import trace

    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "5", "--max-tokens", "100000", "--out", str(tmp_path / "t.parquet"),
                              "--log", str(tmp_path / "t.jsonl")])
    assert args.seed in trace.trace_seeds()
    with pytest.raises(ValueError, match="leaves no room for a prompt"):  # the next check, past the seed's
        trace.run(args)


def test_the_turn_tables_hash_and_cache_follow_every_splits_bytes(tmp_path):
    import hashlib
    import os
    from pathlib import Path

    from training import data_prepare, dataset

    def build(lengths):
        columns = data_prepare.TurnColumns()
        for i, split in enumerate(dataset.SPLITS):
            for name, value in {"conversation_id": f"c{i}", "turn_index": 0, "prompt": f"p{i}", "prompt_tokens": 3,
                                "response_tokens": lengths[i], "split": split, "in_train": False}.items():
                getattr(columns, name).append(value)
        data_prepare.write_table(columns, tmp_path)

    build([10, 11, 12])
    files = dataset.table_files(tmp_path)
    whole = hashlib.sha256(b"".join(Path(files[s]).read_bytes() for s in dataset.SPLITS)).hexdigest()[:16]
    assert dataset.table_hash(tmp_path) == whole  # as the registered runs' data_hash tags recorded it
    assert dataset.load_turns(table_dir=tmp_path)["response_tokens"] == [10, 11, 12]
    stamps = {s: os.stat(files[s]).st_mtime_ns for s in dataset.SPLITS}
    build([10, 11, 21])  # only the test split changes, and keeps its old modification time
    for s, stamp in stamps.items():
        os.utime(files[s], ns=(stamp, stamp))
    assert dataset.table_hash(tmp_path) != whole
    assert dataset.load_turns(table_dir=tmp_path)["response_tokens"] == [10, 11, 21]


def _exact_pairwise_accuracy(true, score) -> float:
    # Every pair i < j with different true lengths; a tie in the score counts half.
    i, j = np.triu_indices(len(true), k=1)
    keep = true[i] != true[j]
    agree = np.sign(true[i] - true[j]) * np.sign(score[i] - score[j])
    return float(np.mean(np.where(agree[keep] == 0, 0.5, agree[keep] > 0)))


def test_pairwise_accuracy_matches_every_pair_counted_and_leaves_out_true_ties():
    # Half the replies tie at a cap of 256: those pairs have no order to get right.
    rng = np.random.default_rng(3)
    true = np.where(rng.random(300) < 0.5, 256.0, rng.integers(1, 256, 300).astype(float))
    score = np.round(true / 64 + rng.normal(0, 1, 300))  # coarse: many score ties too
    assert metrics.pairwise_accuracy(true, score) == pytest.approx(_exact_pairwise_accuracy(true, score), abs=0.005)
    # Three rows by hand: (1, 2) right, (1, 3) and (2, 3) wrong; each row is drawn as often as the others.
    small_true, small_score = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 0.0])
    assert metrics.pairwise_accuracy(small_true, small_score) == pytest.approx(1 / 3, abs=0.005)
    assert np.isnan(metrics.pairwise_accuracy(np.full(5, 7.0), np.arange(5.0)))  # no pair to order
    assert np.isnan(metrics.pairwise_accuracy(np.array([]), np.array([])))  # was "high <= 0": an empty dedup set


def test_training_and_evaluation_refuse_a_split_too_small_before_any_fit(monkeypatch, tmp_path):
    # A table built with `data prepare --limit` can leave a split empty: training died in
    # LightGBM's traceback (or the probe's IndexError), evaluation in "high <= 0".
    from training import evaluate, labels as label_data, train

    def split(rows):
        return label_data.LabelledSplit([f"p{i}" for i in range(rows)], np.arange(1, rows + 1), np.zeros(rows, bool),
                                        np.ones(rows, np.int64), np.zeros(rows, bool))

    sizes = {"train": 50, "validation": 1, "test": 0}
    monkeypatch.setattr(label_data, "load_split", lambda name, labels="sharegpt", held_out=None: split(sizes[name]))
    with pytest.raises(ValueError, match="the sharegpt validation split holds 1 rows"):
        train.load_data("sharegpt", "lexical", None, None)
    with pytest.raises(ValueError, match="the sharegpt test split holds no rows"):
        evaluate.evaluate(Path("data/predictors/lexical"), measure_latency=False)


def test_a_prior_whose_heads_do_not_load_is_a_one_line_error(tmp_path):
    # LightGBMError is no ValueError: a damaged --prior was a traceback naming neither it nor its kind.
    import shutil

    from predictor.saved import read_spec
    from training.labels import trace_held_out_tag
    from training.train_models import _load_prior

    prior = tmp_path / "prior"
    shutil.copytree("data/predictors/default", prior)
    spec = json.loads((prior / "predictor.json").read_text())
    (prior / "predictor.json").write_text(json.dumps({**spec, "held_out": trace_held_out_tag()}))
    (prior / "point.lgb.txt").write_text("not a LightGBM model")
    with pytest.raises(ValueError, match=f"--prior {prior}: its heads do not load"):
        _load_prior(prior, read_spec(prior).feature_spec, "trace")


def test_spearman_is_the_correlation_of_ranks_not_of_values():
    true = np.array([1.0, 2.0, 3.0, 4.0, 1000.0])
    rank_len = np.array([2.0, 1.0, 4.0, 3.0, 1000.0])  # one huge value dominates a Pearson correlation
    result = metrics.prediction_metrics(true, _predictions(rank_len - 1))
    rank = lambda values: np.argsort(np.argsort(values))  # noqa: E731 - distinct values: plain ranks
    assert result.spearman == pytest.approx(np.corrcoef(rank(true), rank(rank_len))[0, 1]) == pytest.approx(0.8)


def test_the_tau_interval_is_as_wide_as_a_95pct_normal_interval_of_tau():
    # Independent true and score: tau's standard error is sqrt(2(2n + 5) / (9n(n - 1))), so a 95%
    # interval spans 2 x 1.96 of it (a 90% one would be 2 x 1.64, 16% narrower).
    rng = np.random.default_rng(0)
    n = 1000
    low, high = metrics.tau_interval(rng.normal(size=n), rng.normal(size=n))
    standard_error = np.sqrt(2 * (2 * n + 5) / (9 * n * (n - 1)))
    assert 0.9 < (high - low) / (2 * 1.959964 * standard_error) < 1.1


def test_a_bucket_of_exactly_ten_rows_is_reported():
    bucket_by = np.arange(50.0)  # five buckets of ten
    true = np.arange(50.0)
    buckets = metrics.tau_by_bucket(true, true, bucket_by)
    assert [b.num_examples for b in buckets] == [10] * 5 and all(b.kendall_tau == pytest.approx(1.0) for b in buckets)


def test_eval_predictor_reports_each_figure_on_its_own_rows(monkeypatch):
    # A stand-in predictor whose score orders differently from its rank_len, a p50 of 64 and a p90
    # at the trace's cap: each figure of the report is then worked out below from the rows alone.
    from pathlib import Path

    from scipy import stats

    from training import evaluate
    from training import labels as label_data

    class Stand:
        kind = "stand-in"
        spec = PredictorSpec(kind="length", feature_spec={}, data_hash="")  # ShareGPT's labels

        def predict(self, prompts):
            return [Prediction(point=len(p) / 8, p50=64.0, p90=cap, score=float(len(p) % 97), rank_len=float(len(p)))
                    for p in prompts]

    test = label_data.subsample(label_data.load_split("test", "trace"), 200, seed=2)
    lengths, cut = test.lengths.astype(float), test.censored
    cap = float(lengths.max())  # every cut reply sits at the cap (test_trace_labels_mark_replies_cut_at_the_cap)
    monkeypatch.setattr(predictor, "load", lambda path: Stand())
    report = evaluate.evaluate(Path("stand-in"), "trace", limit=200, measure_latency=False)

    rank_len = np.array([float(len(p)) for p in test.prompts])
    score = rank_len % 97
    keep = ~test.in_train
    strict = keep & ~label_data.last_message_in_train(test.prompts)
    assert 0 < strict.sum() < keep.sum() < len(keep) and 0 < cut.sum() < len(cut)  # each subset is its own
    tau = lambda x, y: stats.kendalltau(x, y).statistic  # noqa: E731
    assert report.kendall_tau == pytest.approx(tau(rank_len, lengths))
    assert report.kendall_tau_score == pytest.approx(tau(score, lengths))
    assert report.kendall_tau_dedup == pytest.approx(tau(rank_len[keep], lengths[keep]))
    assert report.kendall_tau_dedup_last_message == pytest.approx(tau(rank_len[strict], lengths[strict]))
    assert (report.num_examples, report.num_examples_dedup, report.num_examples_dedup_last_message) == (
        200, keep.sum(), strict.sum())
    assert report.spearman == pytest.approx(stats.spearmanr(rank_len, lengths).statistic)
    assert report.pairwise_accuracy == metrics.pairwise_accuracy(lengths, rank_len)
    # A cut reply is a known miss of a p90 at the cap (its true length is past it) and of a p50 of 64.
    assert report.num_censored == cut.sum()
    assert report.p90_coverage == report.p90_coverage_max == pytest.approx(np.mean(~cut))
    assert report.p50_coverage == report.p50_coverage_max == pytest.approx(np.mean(~cut & (lengths <= 64)))
    assert report.mae_log == pytest.approx(np.mean(np.abs(np.log1p(rank_len / 8) - np.log1p(lengths))[~cut]))
    assert report.kendall_tau_ci95 == metrics.tau_interval(lengths, rank_len)
    assert report.kendall_tau_dedup_ci95 == metrics.tau_interval(lengths[keep], rank_len[keep])
    assert report.latency_ms_p50_batch1 is None and report.kind == "stand-in" and report.labels == "trace"
    # Trained on the trace, its dedup drops the trace's own train prompts, of which the test split
    # repeats none (it dropped the ShareGPT train prompts, which such a predictor never saw), and
    # its stricter cut the last user messages of the trace's train prompts.
    trace_trained = Stand()
    trace_trained.spec = PredictorSpec(kind="length", feature_spec={}, data_hash="", labels="trace")
    monkeypatch.setattr(predictor, "load", lambda path: trace_trained)
    report = evaluate.evaluate(Path("stand-in"), "trace", limit=200, measure_latency=False)
    own_strict = ~label_data.last_message_seen_in_training(test, trace_trained.spec)
    assert 0 < (~own_strict).sum() and own_strict.sum() != strict.sum()
    assert (report.num_examples_dedup, report.num_examples_dedup_last_message) == (200, own_strict.sum())
    assert report.kendall_tau_dedup == pytest.approx(report.kendall_tau)
    assert report.kendall_tau_dedup_last_message == pytest.approx(tau(rank_len[own_strict], lengths[own_strict]))
    # Quantiles a token past the cap: every cut reply's coverage unknown, so the report's bounds
    # part, the lower counting them missed and the upper covered.
    class PastTheCap(Stand):
        def predict(self, prompts):
            return [dataclasses.replace(p, p50=cap + 1, p90=cap + 1) for p in super().predict(prompts)]

    monkeypatch.setattr(predictor, "load", lambda path: PastTheCap())
    report = evaluate.evaluate(Path("stand-in"), "trace", limit=200, measure_latency=False)
    assert report.p90_coverage == pytest.approx(np.mean(~cut)) and report.p90_coverage_max == 1.0
    assert report.p50_coverage == pytest.approx(np.mean(~cut)) and report.p50_coverage_max == 1.0
    # Stacked on a ShareGPT prior that held the trace out, scored on ShareGPT's labels: the prior
    # learned ShareGPT's train split less the trace's prompts, and dedup drops what it learned.
    stacked = Stand()
    prior = {"labels": "sharegpt", "held_out": label_data.trace_held_out_tag()}
    stacked.spec = PredictorSpec(kind="length", feature_spec={"prior": prior}, data_hash="", labels="trace")
    sharegpt_test = label_data.subsample(label_data.load_split("test", "sharegpt"), 400, seed=2)
    seen = label_data.seen_in_training(sharegpt_test, stacked.spec)
    # Held out from another trace than today's: which prompts it learned is unknown, so is its dedup.
    stale = dataclasses.replace(stacked.spec, feature_spec={"prior": {**prior, "held_out": "trace:0123"}})
    with pytest.raises(ValueError, match="held out the trace 0123"):
        label_data.seen_in_training(sharegpt_test, stale)
    from training.trace import load_trace, prompt_key

    # ShareGPT's train rows it kept: outside the trace's conversations as well as its prompts.
    learned = set(label_data.load_split("train", "sharegpt", label_data.trace_held_out()).prompts)
    in_learned = np.array([p in learned for p in sharegpt_test.prompts])
    trace_train = set(load_trace("train")["key"])
    in_trace_train = np.array([prompt_key(p) in trace_train for p in sharegpt_test.prompts])
    assert (seen == (in_learned | in_trace_train)).all()
    assert 0 < seen.sum() and in_learned.sum() > 0
