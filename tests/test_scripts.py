"""The scripts under scripts/: bad input is refused in one line before any model or data loads."""

from __future__ import annotations

import pytest


def load_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_in_sim_refuses_simulator_flags_it_would_ignore(capsys, monkeypatch) -> None:
    from training import bench_serve

    replay = load_script("replay_bench_in_sim")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("workload loaded first"))
    with pytest.raises(SystemExit) as exited:
        replay.main(["--sim-args", "--policies fcfs --load=0.5 --max-num-seqs 8 --json x.json", "--",
                     "--num-prompts", "2"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in err
    assert "--json --load --policies: not honoured" in err and "--max-num-seqs" not in err
    honoured = replay.parse_sim_args("--max-num-seqs 8 --kv-blocks=100 --admission --srpt-max-preempt-share 0.2")
    assert (honoured.max_num_seqs, honoured.kv_blocks, honoured.admission) == (8, 100, True)
    assert honoured.srpt_max_preempt_share == 0.2  # a scheduler knob, as the server takes it
    with pytest.raises(SystemExit) as exited:  # refused before the workload, not after its predictions
        replay.parse_sim_args("--max-queued-tokens 100")
    assert exited.value.code == 2 and "--max-queued-tokens needs --admission" in capsys.readouterr().err


def test_replay_in_sim_needs_ignore_eos_before_loading(monkeypatch) -> None:
    # Without it a reply may stop early, so max_tokens is no longer the length to replay.
    from training import bench_serve

    replay = load_script("replay_bench_in_sim")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("workload loaded first"))
    with pytest.raises(ValueError, match="--ignore-eos"):
        replay.main(["--", "--num-prompts", "2"])


def test_replay_engine_checks_its_policies_before_loading(capsys, monkeypatch) -> None:
    import predictor
    from training import bench_serve

    replay = load_script("replay_engine")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("workload loaded first"))
    monkeypatch.setattr(predictor, "load", lambda path: pytest.fail("predictor loaded first"))
    with pytest.raises(SystemExit) as exited:
        replay.main(["--policies", "fcfs,bogus", "--", "--num-prompts", "2"])
    assert exited.value.code == 2 and "unknown policies bogus" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["32x400", "--steps", "0"], "argument --steps: must be a positive integer"),
    (["2x4000"], "leaves no room for 12 decode steps"), (["3y4"], "a shape is BATCHxCONTEXT"),
    (["33x10"], "above max_num_seqs 32"),
])
def test_decode_step_probe_checks_its_shapes_before_loading(capsys, monkeypatch, argv, message) -> None:
    from engine import llm_engine

    probe = load_script("decode_step_probe")
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config: pytest.fail("model loaded first"))
    monkeypatch.setattr("sys.argv", ["decode_step_probe.py", *argv])  # the old main() read sys.argv
    with pytest.raises(SystemExit) as exited:
        probe.main()
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_decode_step_probe_refuses_a_shape_the_kv_cache_cannot_hold() -> None:
    from engine.config import EngineConfig

    probe = load_script("decode_step_probe")
    config = EngineConfig()
    assert probe.shape_problem(32, 600, 12, config, kv_blocks=1456) is None  # the README's shapes
    assert "needs up to 2176 KV blocks" in probe.shape_problem(32, 1000, 12, config, kv_blocks=1456)


def test_serve_step_log_without_its_file_is_one_line() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "STEP_LOG"}
    done = subprocess.run([sys.executable, str(root / "scripts" / "serve_step_log.py"), "serve"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "set STEP_LOG=FILE" in done.stderr


def test_margin_vs_load_refuses_the_flags_it_decides_and_survives_a_run_without_samples(capsys) -> None:
    script = load_script("margin_vs_load")
    with pytest.raises(SystemExit) as exited:
        script.main(["--policies", "sjf", "--load=0.5"])
    assert exited.value.code == 2 and "--policies, --load: not used here" in capsys.readouterr().err
    assert script.margin_summary(0.5, []) == {"load": 0.5, "num_samples": 0}
    assert script.margin_summary(0.5, [0.2, 0.4, 0.3])["median"] == 0.3


def test_step_log_fit_recovers_the_cost_of_logged_steps(tmp_path) -> None:
    import json

    fit = load_script("step_log_fit")
    lines, t = [], 0.0
    for tokens, context in [(512, 512), (40, 900), (32, 4000), (300, 2500), (64, 6400), (8, 300)]:
        seconds = 0.05 + 0.001 * tokens + 2e-6 * context
        lines.append(json.dumps({"t0": t, "t1": t + seconds, "cpu": seconds, "num_batched_tokens": tokens,
                                 "sum_context_tokens": context}))
        t += seconds + 0.01
    (tmp_path / "fcfs_steps.jsonl").write_text("\n".join(lines) + "\n")
    result = fit.fit_steps(tmp_path / "fcfs_steps.jsonl")
    assert result["steps"] == 6 and result["batched_tokens"] == 956 and result["gaps_s"] == pytest.approx(0.05)
    assert (result["a_ms"], result["b_ms_per_token"], result["c_us_per_context_token"]) == pytest.approx((50, 1, 2))


def test_step_log_fit_reads_the_engine_replays_logs_too(tmp_path) -> None:
    # scripts/replay_engine.py times each step (step_time_s) without its bounds or CPU time: the
    # fit it backs in the measurement record failed on a KeyError for t0.
    import json

    fit = load_script("step_log_fit")
    lines = [json.dumps({"t": 1.0, "num_batched_tokens": tokens, "num_seqs": 4, "sum_context_tokens": context,
                         "step_time_s": 0.05 + 0.001 * tokens + 2e-6 * context, "forward_time_s": 0.04,
                         "waiting": 0})
             for tokens, context in [(512, 512), (40, 900), (32, 4000), (300, 2500), (64, 6400), (8, 300)]]
    (tmp_path / "sjf_steps.jsonl").write_text("\n".join(lines) + "\n")
    result = fit.fit_steps(tmp_path / "sjf_steps.jsonl")
    assert result["cpu_s"] is None and result["gaps_s"] is None and result["steps"] == 6
    assert (result["a_ms"], result["b_ms_per_token"], result["c_us_per_context_token"]) == pytest.approx((50, 1, 2))


def test_replay_engine_replays_the_tiers_and_refuses_what_it_cannot_replay(capsys, monkeypatch, tmp_path) -> None:
    # It forced every reply to its max_tokens without --ignore-eos, and served a tier mix all
    # standard: another workload than the bench run's, said nowhere.
    import predictor
    from engine import llm_engine
    from predictor.base import Prediction

    replay = load_script("replay_engine")
    for extra, message in ((["--num-prompts", "2"], "--ignore-eos"),
                           (["--num-prompts", "2", "--ignore-eos", "--max-concurrency", "1"], "--max-concurrency")):
        with pytest.raises(SystemExit) as exited:
            replay.main(["--", *extra])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    added = []

    class Engine:
        def __init__(self, config):
            self.queued = []
            self.last_step = llm_engine.StepRecord(1, 1, 1, 0.01, 0.01)

        def add_request(self, request_id, prompt, params, tier, prediction):
            added.append((request_id, tier, params.ignore_eos))
            self.queued.append(request_id)

        def has_unfinished_requests(self):
            return bool(self.queued)

        def step(self):
            done, self.queued = self.queued, []
            return [type("Out", (), {"finished": True, "request_id": r, "token_ids": (1,)})() for r in done]

        def stats(self):
            return type("Stats", (), {"scheduler": type("S", (), {"num_waiting": 0})()})()

    class Stand:
        def predict(self, prompts):
            return [Prediction(point=10.0, p50=10.0, p90=20.0, score=10.0, rank_len=10.0) for _ in prompts]

    monkeypatch.setattr(llm_engine, "LLMEngine", Engine)
    monkeypatch.setattr(predictor, "load", lambda path: Stand())
    replay.main(["--policies", "fcfs", "--out-dir", str(tmp_path), "--", "--num-prompts", "8", "--ignore-eos",
                 "--request-rate", "inf", "--seed", "0", "--tier-mix", "interactive:0.5,batch:0.5"])
    from training import bench_serve

    bench_parser = __import__("argparse").ArgumentParser()
    bench_serve.add_arguments(bench_parser)
    items = bench_serve.sample_workload(bench_parser.parse_args(["--num-prompts", "8", "--ignore-eos", "--seed", "0",
                                                                 "--tier-mix", "interactive:0.5,batch:0.5"]))
    expected = {str(i): item.tier for i, item in enumerate(items)}
    assert {r: t.name.lower() for r, t, _ in added} == expected and len(set(expected.values())) == 2


def test_step_log_fit_refuses_a_log_it_cannot_read_in_one_line(capsys, tmp_path) -> None:
    fit = load_script("step_log_fit")
    for name, text in (("fcfs_steps.jsonl", "{not json\n"), ("fcfs_steps.jsonl", '{"t0": 1}\n')):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exited:
            fit.main([str(tmp_path), "--policies", "fcfs"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exited.value.code == 2 and "not a step log of scripts/serve_step_log.py" in err


def test_serve_step_log_keeps_an_old_log_until_the_server_steps(tmp_path, monkeypatch) -> None:
    import engine.llm_engine as llm_engine

    script = load_script("serve_step_log")
    old = tmp_path / "steps.jsonl"
    old.write_text("an earlier run\n")
    monkeypatch.setattr(llm_engine.LLMEngine, "step", llm_engine.LLMEngine.step)  # restored after the test
    script.install_step_log(str(old))
    assert old.read_text() == "an earlier run\n"  # a serve that fails to start loses nothing
    with pytest.raises(PermissionError, match="STEP_LOG /proc/steps.jsonl: not writable"):
        script.install_step_log("/proc/steps.jsonl")


def test_replay_engine_checks_its_out_dir_and_predictor_before_predicting(capsys, monkeypatch, tmp_path) -> None:
    import predictor

    replay = load_script("replay_engine")
    monkeypatch.setattr(predictor, "load", lambda path: pytest.fail("predicted first"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for flags, message in ((["--out-dir", str(a_file)], "is a file, not a folder"),
                           (["--predictor", str(tmp_path)], "not a saved predictor folder")):
        with pytest.raises(SystemExit) as exited:
            replay.main([*flags, "--", "--num-prompts", "2", "--ignore-eos"])
        assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("layers, message", [("0,16", "numbered from 1"), ("16,x", "comma-separated"), ("", "comma")])
def test_probe_layer_sweep_checks_its_layers_before_loading(capsys, monkeypatch, layers, message) -> None:
    from predictor import probe

    sweep = load_script("probe_layer_sweep")
    monkeypatch.setattr(probe, "HiddenStateProbe", lambda config: pytest.fail("model loaded first"))
    monkeypatch.setattr("sys.argv", ["probe_layer_sweep.py", "--layers", layers])
    with pytest.raises(SystemExit) as exited:
        sweep.main()
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert sweep.layer_list("16,4,16") == [4, 16]


def test_probe_variants_pools_each_prompt_alone_whatever_it_is_batched_with(tiny_model_dir) -> None:
    import dataclasses

    import numpy as np

    from predictor.probe import HiddenStateProbe, ProbeConfig

    variants = load_script("probe_variants")
    probe = HiddenStateProbe(ProbeConfig(model_ref=str(tiny_model_dir), layer=2, max_tokens=64, batch_size=4))
    prompts = ["Write an essay about rivers and the towns along them.", "hi", "Translate: good morning"]
    batched = variants.pooled_states(probe, prompts, layers=(1, 2))
    alone = dataclasses.replace(probe.config, batch_size=1)
    probe.config = alone
    for row, prompt in enumerate(prompts):
        single = variants.pooled_states(probe, [prompt], layers=(1, 2))
        for name, features in single.items():
            np.testing.assert_allclose(batched[name][row], features[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(batched["2_last"], probe.encode(prompts), rtol=2e-3, atol=2e-3)
    assert not np.allclose(batched["2_last"], batched["2_mean"])


def test_probe_variants_checks_its_json_before_computing_states(capsys, monkeypatch) -> None:
    from predictor import probe

    variants = load_script("probe_variants")
    monkeypatch.setattr(probe, "HiddenStateProbe", lambda config: pytest.fail("model loaded first"))
    with pytest.raises(SystemExit) as exited:
        variants.main(["--json", "/proc/variants.json"])
    assert exited.value.code == 2 and "--json /proc/variants.json: not writable" in capsys.readouterr().err


def test_replay_in_sim_reports_what_the_max_tokens_clamp_adds_to_the_order() -> None:
    # Predictions above every true length and in reverse order: alone they rank backwards, clamped
    # to max_tokens (each request's true length, as with --ignore-eos) they rank perfectly.
    from scheduler.simulation import SimRequest

    replay = load_script("replay_bench_in_sim")
    workload = [SimRequest(f"r{i}", 0.0, 8, true_len, predicted_len=1000.0 - true_len, max_tokens=None,
                           predicted_rank_len=1000.0 - true_len) for i, true_len in enumerate((5, 50, 500))]
    assert replay.ranking_taus(workload) == ("Kendall's tau against the true lengths: sjf's key (prediction "
                                             "clamped to max_tokens) 1.000, the prediction alone -1.000")
    # "Alone" is the ranking head the key is built from, not the point estimate beside it.
    ranked = [SimRequest(f"r{i}", 0.0, 8, true_len, predicted_len=1.0 - i, max_tokens=None,
                         predicted_rank_len=float(true_len)) for i, true_len in enumerate((5, 50, 500))]
    assert replay.ranking_taus(ranked).endswith("the prediction alone 1.000")


@pytest.mark.parametrize("flag", ["--aging-tokens-per-step", "--aging-tokens-per-s", "--srpt-max-preempt-share",
                                  "--goodput-urgent-slack"])
def test_margin_vs_load_refuses_the_length_policies_knobs_it_would_ignore(capsys, flag) -> None:
    script = load_script("margin_vs_load")
    with pytest.raises(SystemExit) as exited:
        script.main([flag, "0.5"])
    assert exited.value.code == 2 and f"{flag}: not used here" in capsys.readouterr().err


@pytest.mark.parametrize("cap_args, capped", [(["--max-output-tokens", "512"], 512),
                                               ([], 2048 - 20)])  # the rest of the context, not the true length
def test_replay_in_sim_runs_sjf_again_on_the_prediction_alone_and_compares_only_like_with_like(
        tmp_path, monkeypatch, capsys, cap_args, capped) -> None:
    import json

    import scheduler.simulation
    from training import bench_serve, sim_workload
    from training.sim_workload import Predicted

    replay = load_script("replay_bench_in_sim")
    items = [bench_serve.WorkItem(i, f"prompt {i}", 20, true_len, "standard") for i, true_len in enumerate((300, 8, 60))]
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: items)
    monkeypatch.setattr(sim_workload, "predictor_predictions",
                        lambda turns, path: [Predicted(50.0, 50.0, 90.0, 50.0) for _ in turns])
    runs, real_simulate = [], scheduler.simulation.simulate

    def recording_simulate(config, requests, cost, *args, **kwargs):
        runs.append((config.policy, [r.max_tokens for r in requests]))
        return real_simulate(config, requests, cost, *args, **kwargs)

    monkeypatch.setattr(scheduler.simulation, "simulate", recording_simulate)
    (tmp_path / "sjf.json").write_text(json.dumps({"mean_e2e_s": 1.0, "p50_e2e_s": 1.0, "p99_e2e_s": 1.0,
                                                   "requests": []}))
    replay.main(["--result-dir", str(tmp_path), "--", "--num-prompts", "3", "--ignore-eos", *cap_args,
                 "--request-rate", "inf"])
    assert [policy for policy, _ in runs] == ["fcfs", "sjf", "oracle", "sjf"]
    assert runs[1][1] == [None, None, None] and runs[3][1] == [capped] * 3  # true lengths, then the cap
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"arrivals drawn as bench serve draws them (no fcfs.json in {tmp_path})")
    real = {line.split(" sim ")[0].strip(): "| real" in line for line in lines if " sim mean " in line}
    assert real == {"fcfs": False, "sjf": True, "oracle": False, "sjf, prediction alone": False}


def test_replay_in_sim_refuses_a_result_dir_that_is_no_folder_before_loading(tmp_path, monkeypatch) -> None:
    # A mistyped folder replayed drawn arrivals as if no run had been measured, without a word.
    from training import bench_serve

    replay = load_script("replay_bench_in_sim")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("workload loaded first"))
    with pytest.raises(ValueError, match=f"--result-dir {tmp_path / 'typo'}: no such folder"):
        replay.main(["--result-dir", str(tmp_path / "typo"), "--", "--num-prompts", "2", "--ignore-eos"])


def test_replay_in_sim_refuses_a_measured_run_of_another_workload_before_loading(tmp_path, monkeypatch) -> None:
    # Replayed with other bench arguments, its figures sat beside another workload's (or a missing
    # index was a KeyError).
    import argparse
    import json

    from training import bench_serve

    replay = load_script("replay_bench_in_sim")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("workload loaded first"))
    (tmp_path / "fcfs.json").write_text(json.dumps({"config": {"num_prompts": 20, "seed": 0}, "requests": []}))
    for bench_args, named in ((["--num-prompts", "30"], "--num-prompts 20 (given 30)"),
                              (["--num-prompts", "20", "--seed", "7"], "--seed 0 (given 7)")):
        with pytest.raises(ValueError, match=r"fcfs\.json was measured with " + named.replace("(", r"\(")
                           .replace(")", r"\)")):
            replay.main(["--result-dir", str(tmp_path), "--", *bench_args, "--ignore-eos"])
    # A run at an unbounded rate writes it as vLLM's "inf" (strict JSON): the same as --request-rate
    # inf, which parses to a float.
    check_args = argparse.Namespace(num_prompts=20, seed=0, request_rate=float("inf"))
    replay.check_same_workload({"fcfs": {"config": {"num_prompts": 20, "seed": 0, "request_rate": "inf"}}},
                               check_args)
    with pytest.raises(ValueError, match="--request-rate inf"):
        replay.check_same_workload({"fcfs": {"config": {"request_rate": "inf"}}},
                                   argparse.Namespace(request_rate=1.0))
    # What it leaves unchecked is named among the comparison's workload keys, so a key added there
    # is checked here too.
    from training.bench_serve_compare import WORKLOAD_KEYS

    assert replay.NOT_REPLAYED < set(WORKLOAD_KEYS)


def test_margin_vs_load_refuses_an_abbreviation_of_a_flag_it_decides(capsys) -> None:
    # An abbreviation slipped past the check on whole flag names and was silently ignored.
    script = load_script("margin_vs_load")
    with pytest.raises(SystemExit) as exited:
        script.main(["--polic", "sjf"])
    assert exited.value.code == 2 and "unrecognized arguments: --polic" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--probe", "data/predictors/finetune"], "--probe data/predictors/finetune: a finetune predictor, not a probe"),
    (["--finetune", "data/predictors/nowhere"], "--finetune: data/predictors/nowhere/predictor.json not found"),
    (["--head-lr", "0"], "argument --head-lr: must be a positive number, got 0"),
    (["--epochs", "0"], "argument --epochs: must be a positive integer"),
])
def test_trace_transfer_checks_its_predictors_before_loading(capsys, monkeypatch, argv, message) -> None:
    from predictor import saved

    script = load_script("trace_transfer")
    monkeypatch.setattr(saved, "load", lambda path: pytest.fail("predictor loaded first"))
    with pytest.raises(SystemExit) as exited:
        script.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and message in err


def test_the_admission_burst_script_times_every_policy_and_tier(tmp_path, capsys) -> None:
    import json

    burst = load_script("admission_burst")
    out = tmp_path / "burst.json"
    assert burst.main(["--num-requests", "20", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(run["policy"], run["tier"]) for run in runs} == {(p, t) for p in ("fcfs", "sjf") for t in ("batch", "standard")}
    assert all(run["refused"] == 0 and run["admission_s"] > 0 for run in runs)
    with pytest.raises(SystemExit) as exited:
        burst.main(["--num-requests", "0"])
    assert exited.value.code == 2 and "--num-requests must be at least 1" in capsys.readouterr().err
