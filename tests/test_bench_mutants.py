"""Tests a mutation run of the benchmark and simulator drivers found missing: each checks what a
command sends, counts or reports against a reference computed here, not read back from the code.

`bench serve` is driven against a recording server (FastAPI on a real socket): the client's side
of the protocol (the payload, the schedule, the counting) is what is under test, and a real
engine could not show which max_tokens or service tier a request carried."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from test_server import running_server
from test_server_bench import bench_args
from test_simulator import COST, synthetic_workload
from training import bench_serve
from training.dataset import DEFAULT_TABLE_DIR

TEST_TABLE = DEFAULT_TABLE_DIR / "test.parquet"


def recording_app(behaviour: dict[int, str] | None = None, hold_s: float = 0.0, preemptions_per_scrape: float = 3.0,
                  served: tuple[dict, ...] = ({"id": "m", "max_model_len": 4096},),
                  metrics_reply: tuple[int, str] | None = None):
    """A server that records each completion request (payload, headers) and answers with two
    token chunks `hold_s` apart, then, `hold_s` later, a usage count of max_tokens and [DONE].
    `behaviour` changes the answer to the Nth request (by arrival): "short" counts one token
    less, "refuse" is HTTP 429, "abort" ends with finish_reason abort, "truncate" leaves out
    [DONE], "error" sends an error event after its first token and ends without [DONE]. Each
    /metrics scrape reports `preemptions_per_scrape` more preemptions than the last, unless
    `metrics_reply` gives the (status, body) to answer instead."""
    behaviour = behaviour or {}
    app = FastAPI()
    app.state.sent, app.state.in_flight, app.state.peak, app.state.scrapes = [], 0, 0, 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{**model, "object": "model"} for model in served]}

    @app.get("/metrics")
    async def metrics():
        app.state.scrapes += 1
        if metrics_reply is not None:
            return PlainTextResponse(metrics_reply[1], status_code=metrics_reply[0])
        return PlainTextResponse(
            '# TYPE lengthwise:server_info gauge\nlengthwise:server_info{policy="fcfs"} 1.0\n'
            "# TYPE lengthwise:num_preemptions counter\n"
            f"lengthwise:num_preemptions_total {preemptions_per_scrape * app.state.scrapes}\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        payload = await request.json()
        kind = behaviour.get(len(app.state.sent), "")
        app.state.sent.append({"payload": payload, "auth": request.headers.get("authorization")})
        if kind == "refuse":
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)
        tokens = payload["max_tokens"] - (1 if kind == "short" else 0)
        last = "abort" if kind == "abort" else "length"

        async def stream():
            app.state.in_flight += 1
            app.state.peak = max(app.state.peak, app.state.in_flight)
            yield 'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'
            if kind == "error":
                app.state.in_flight -= 1
                yield 'data: {"error": {"message": "the engine failed"}}\n\n'
                return
            await asyncio.sleep(hold_s)
            yield f'data: {{"choices": [{{"text": "", "finish_reason": "{last}"}}]}}\n\n'
            await asyncio.sleep(hold_s)
            app.state.in_flight -= 1
            yield f'data: {{"choices": [], "usage": {{"completion_tokens": {tokens}}}}}\n\n'
            if kind != "truncate":
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def run_bench(base_url: str, tmp_path, *flags: str) -> tuple[int, dict]:
    from training.cli import main

    code = main(["bench", "serve", "--base-url", base_url, "--no-mlflow", "--result-dir", str(tmp_path), *flags])
    (result,) = tmp_path.glob("*.json")
    return code, json.loads(result.read_text())


@pytest.mark.parametrize("metrics", [(404, '{"detail": "Not Found"}'), (500, "Internal Server Error"),
                                     (200, "<html>a proxy's page</html>")])
def test_a_server_without_prometheus_metrics_still_gets_its_run_measured_and_written(tmp_path, metrics):
    # A body that is no Prometheus text raised in the parser: before the load the command could not
    # run against such a server, and after it (an engine failing its collector) the run was lost.
    with running_server(recording_app(metrics_reply=metrics)) as (base_url, _):
        code, result = run_bench(base_url, tmp_path, "--num-prompts", "2", "--request-rate", "inf")
    assert code == 0 and result["completed"] == 2 and "server_preemptions" not in result


def test_the_result_is_strict_json_with_an_unbounded_rate_as_vllm_writes_it(tmp_path):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    with running_server(recording_app()) as (base_url, _):
        run_bench(base_url, tmp_path, "--num-prompts", "2", "--request-rate", "inf")
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text(), parse_constant=refuse)["config"]["request_rate"] == "inf"


def test_a_stream_error_keeps_its_reason_when_no_done_follows(tmp_path):
    with running_server(recording_app({0: "error"})) as (base_url, _):
        code, result = run_bench(base_url, tmp_path, "--num-prompts", "1", "--request-rate", "inf")
    assert code == 1 and result["failed"] == 1
    assert result["requests"][0]["error"] == "stream error: the engine failed"


def test_bench_serve_sends_each_turn_with_its_reply_length_tier_and_flags_and_counts_what_came_back(tmp_path):
    app = recording_app({1: "short", 4: "refuse", 5: "abort", 6: "truncate"})
    with running_server(app) as (base_url, _):
        code, result = run_bench(base_url, tmp_path, "--num-prompts", "8", "--request-rate", "inf", "--seed", "3",
                                 "--ignore-eos", "--max-output-tokens", "100", "--max-model-len", "1024",
                                 "--tier-mix", "interactive:1,batch:1", "--temperature", "0.5",
                                 "--max-concurrency", "1", "--api-key", "sekrit")
    table = pd.read_parquet(TEST_TABLE)
    replies = table.groupby("prompt")["response_tokens"].apply(set).to_dict()
    sent = [entry["payload"] for entry in app.state.sent]
    assert len(sent) == 8
    for payload in sent:  # the dataset's reply length, capped: what the turn's reply was
        assert payload["max_tokens"] in {min(r, 100) for r in replies[payload["prompt"]]}
        assert (payload["model"], payload["stream"], payload["stream_options"]) == ("m", True, {"include_usage": True})
        assert (payload["ignore_eos"], payload["temperature"]) == (True, 0.5)
    assert any(p["max_tokens"] < 100 for p in sent) and any(p["max_tokens"] == 100 for p in sent)
    assert {entry["auth"] for entry in app.state.sent} == {"Bearer sekrit"}
    assert "sekrit" not in json.dumps(result)  # the key is a secret: never in the result file
    # Each request's service tier is its own tier's; both tiers of the mix were drawn.
    service = {"interactive": "priority", "batch": "flex"}
    assert Counter(p["service_tier"] for p in sent) == Counter(service[r["tier"]] for r in result["requests"])
    assert set(p["service_tier"] for p in sent) == {"priority", "flex"}
    assert app.state.peak == 1  # --max-concurrency 1
    # ...so each request is sent (start_s: when it was sent, not when it was due) after the one
    # before it ended.
    timed = sorted((r["start_s"], r["e2e_s"]) for r in result["requests"])
    assert all(start + e2e <= next_start for (start, e2e), (next_start, _) in zip(timed, timed[1:]) if e2e)
    # One a token short, three failed, each with its reason: every request counted once, and
    # only a completed one can be short.
    assert (result["completed"], result["failed"], result["rejected_429"], result["short_outputs"]) == (5, 3, 1, 1)
    assert [e.split(":")[0] for e in result["errors"]] == ["HTTP 429", "aborted by the server",
                                                           "stream ended without [DONE]"]
    assert sorted(r["max_tokens"] for r in result["requests"]) == sorted(p["max_tokens"] for p in sent)
    assert result["server_preemptions"] == 3.0  # two scrapes, 3 preemptions apart
    assert result["config"]["label"] == "fcfs-rateinf" and result["offered_request_rate_rps"] is None
    assert code == 1  # a failed request fails the run


def test_bench_serve_sends_on_its_gamma_schedule_and_all_at_once_without_a_cap(tmp_path):
    hold = 0.3
    app = recording_app(hold_s=hold)
    rate, burstiness, seed, n = 25.0, 0.5, 5, 6
    with running_server(app) as (base_url, _):
        code, result = run_bench(base_url, tmp_path, "--num-prompts", str(n), "--request-rate", str(rate),
                                 "--burstiness", str(burstiness), "--seed", str(seed), "--max-output-tokens", "4",
                                 "--label", "gamma")
    # numpy's gamma with shape k and scale 1 / (rate k) has mean 1/rate; the first request leaves at 0.
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    expected = np.cumsum(np.concatenate([[0.0], gaps[1:]]))
    starts = np.array(sorted(r["start_s"] for r in result["requests"]))
    assert np.all(starts >= expected - 1e-6)  # no request leaves before its time
    assert result["offered_request_rate_rps"] == pytest.approx((n - 1) / expected[-1])
    assert code == 0 and result["completed"] == n and app.state.peak > 1  # no cap: requests overlap
    # Neither asked for: not sent, as vLLM's client leaves them out (a strict endpoint refuses them).
    assert all({"ignore_eos", "service_tier"}.isdisjoint(entry["payload"]) for entry in app.state.sent)
    # The first token's time, one gap to the second token, and the end at the last token: not at
    # the usage chunk and [DONE] a pause later (that would add the whole pause, against the
    # microseconds between two clock reads at one chunk; no bound on how long a gap takes).
    for r in result["requests"]:
        (gap,) = r["itl_s"]
        assert gap > 0 and r["e2e_s"] > r["ttft_s"]
        assert abs(r["e2e_s"] - (r["ttft_s"] + gap)) < hold / 2


def test_bench_serve_sends_the_first_served_model_and_reads_the_context_of_the_one_named(tmp_path, capsys):
    from training.cli import main

    app = recording_app(served=({"id": "m", "max_model_len": 512}, {"id": "big", "max_model_len": 4096}))
    flags = ("--num-prompts", "2", "--max-output-tokens", "4")
    with running_server(app) as (base_url, _):
        assert run_bench(base_url, tmp_path / "big", "--model", "big", "--max-model-len", "1024", *flags)[0] == 0
        assert {entry["payload"]["model"] for entry in app.state.sent} == {"big"}
        assert run_bench(base_url, tmp_path / "first", "--max-model-len", "512", *flags)[0] == 0
        assert app.state.sent[-1]["payload"]["model"] == "m"
        assert main(["bench", "serve", "--base-url", base_url, "--no-mlflow", "--max-model-len", "1024", *flags,
                     "--result-dir", str(tmp_path / "refused")]) == 2
    assert "exceeds the server's max_model_len 512" in capsys.readouterr().err


def test_sample_workload_draws_by_seed_among_every_turn_that_fits():
    table = pd.read_parquet(TEST_TABLE)
    fits = table[(table.prompt_tokens >= 4) & (table.response_tokens >= 4)
                 & (table.prompt_tokens + table.response_tokens <= 300)]
    everything = bench_serve.sample_workload(bench_args(num_prompts=len(fits), max_model_len=300))
    assert Counter(item.prompt for item in everything) == Counter(fits.prompt)
    with pytest.raises(ValueError, match="only"):
        bench_serve.sample_workload(bench_args(num_prompts=len(fits) + 1, max_model_len=300))
    # Each item's own prompt length and reply length (uncapped here) travel with its prompt.
    lengths = set(zip(fits.prompt, fits.prompt_tokens, fits.response_tokens))
    assert all((item.prompt, item.prompt_tokens, item.max_tokens) in lengths for item in everything)
    first, again, other = (bench_serve.sample_workload(bench_args(num_prompts=20, seed=seed)) for seed in (1, 1, 2))
    assert first == again and [i.prompt for i in first] != [i.prompt for i in other]


def test_sample_workload_draws_tiers_by_the_mix_weights():
    items = bench_serve.sample_workload(bench_args(num_prompts=2000, max_model_len=4096,
                                                   tier_mix="interactive:1,batch:3"))
    share = Counter(item.tier for item in items)["interactive"] / len(items)
    assert share == pytest.approx(0.25, abs=0.04)  # binomial sd 0.01 at 2000 draws


def test_arrival_offsets_follow_the_seed():
    assert bench_serve.arrival_offsets(5, 2.0, 1.0, 7) == bench_serve.arrival_offsets(5, 2.0, 1.0, 7)
    assert bench_serve.arrival_offsets(5, 2.0, 1.0, 7) != bench_serve.arrival_offsets(5, 2.0, 1.0, 8)


def test_a_tier_mix_takes_zero_shares_but_no_negative_infinite_or_all_zero_one():
    assert bench_serve.parse_tier_mix("interactive:0,standard:2") == {"interactive": 0.0, "standard": 2.0}
    for text in ("interactive:-1,standard:2", "interactive:inf", "interactive:nan", "interactive:0,batch:0"):
        with pytest.raises(ValueError):
            bench_serve.parse_tier_mix(text)


# ---- lengthwise simulate

def sim_args(*argv: str) -> argparse.Namespace:
    from training import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args(list(argv))


def sim_workload(count: int, seed: int = 0):
    """test_simulator's synthetic requests, every one at t=0: arrivals are run_load's to draw."""
    from dataclasses import replace

    return [replace(request, arrival_time=0.0) for request in synthetic_workload(count, rate=1.0, seed=seed)]


SIM_CONFIG = dict(num_gpu_blocks=40, block_size=8, max_num_seqs=8, max_num_batched_tokens=96, max_model_len=288)


def same_figures(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN-safe equality


@pytest.mark.parametrize("flags, load", [(("--seed", "4"), 0.6), (("--arrival", "gamma", "--arrival-cv", "3",
                                                                    "--seed", "2"), 1.3)])
def test_run_load_offers_load_times_saturated_over_the_mean_reply_on_the_asked_arrivals(flags, load):
    from dataclasses import replace

    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate
    from training import sim_metrics
    from training.simulate import arrival_cv_of, run_load
    from training.sim_workload import arrival_times

    args = sim_args(*flags)
    cost = COST
    # Admission on and overloaded at 1.3: some requests are refused and have no latency to plot.
    config = SchedulerConfig(**SIM_CONFIG, enable_admission=load > 1, max_queued_tokens=400)
    base, saturated = sim_workload(60), 400.0
    main, latencies = run_load(config, base, cost, ["fcfs"], load, saturated, args)
    rate = load * saturated / np.mean([r.output_tokens for r in base])  # requests/s
    assert main["load"] == load and main["arrival_rate_per_s"] == pytest.approx(rate)
    times = arrival_times(len(base), rate, args.arrival, arrival_cv_of(args), args.seed)
    assert main["offered_load"] == pytest.approx(load * len(times) / times[-1] / rate)  # what the draw offered
    assert main["offered_load"] != pytest.approx(load, abs=1e-3)
    result = simulate(replace(config, policy="fcfs"), [replace(r, arrival_time=t) for r, t in zip(base, times)], cost)
    expected = sim_metrics.summarize(result, config.slo_ttft_interactive_s, config.slo_e2e_standard_s)
    assert same_figures(main["policies"]["fcfs"], expected)
    assert latencies["fcfs"] == [r.e2e_s for r in result.records if not r.rejected]
    assert (len(latencies["fcfs"]) < len(base)) == (load > 1)  # the overloaded case did shed


def test_the_aging_figures_are_the_slowest_rate_and_the_largest_bound_of_the_run():
    from dataclasses import replace

    from scheduler.config import SchedulerConfig
    from scheduler.policies import make_policy
    from scheduler.simulation import simulate
    from training.sim_metrics import aging_bounds
    from training.simulate import run_load
    from training.sim_workload import arrival_times

    args, cost = sim_args("--seed", "1"), COST
    config, base = SchedulerConfig(**SIM_CONFIG), sim_workload(60, seed=3)
    main, _ = run_load(config, base, cost, ["sjf"], 1.0, 400.0, args)
    rate = 400.0 / np.mean([r.output_tokens for r in base])
    workload = [replace(r, arrival_time=t) for r, t in zip(base, arrival_times(60, rate, "poisson", 1.0, 1))]
    policy = make_policy("sjf", replace(config, policy="sjf"))
    policy.record_rate_history = True
    result = simulate(replace(config, policy="sjf"), workload, cost, policy)
    bounds = aging_bounds(policy, workload, result.records)
    figures = main["policies"]["sjf"]
    assert figures["aging_tokens_per_s"] == policy.slowest_rate_while_waiting != policy.aging_rate
    assert figures["aging_bound_s"] == max(bounds.values()) > min(bounds.values())


def test_saturated_throughput_is_every_request_at_once_under_fcfs_without_admission():
    from dataclasses import replace

    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate
    from training.simulate import saturated_throughput

    cost, base = COST, sim_workload(60)
    config = SchedulerConfig(**SIM_CONFIG)
    result = simulate(replace(config, policy="fcfs"), base, cost)
    expected = sum(r.output_tokens for r in base) / result.makespan_s
    admitting = replace(config, enable_admission=True, max_queued_tokens=400)  # would shed at t=0
    assert saturated_throughput(config, base, cost) == pytest.approx(expected)
    assert saturated_throughput(admitting, base, cost) == pytest.approx(expected)


def test_the_swap_pool_has_at_least_one_block():
    from training.simulate import engine_host_blocks

    assert engine_host_blocks(1) == 1 and engine_host_blocks(3) == 2  # half, rounded, never none


def test_the_base_workload_sends_the_output_cap_and_draws_the_asked_tiers():
    from scheduler.request import Tier
    from training.simulate import build_base_workload
    from training.sim_workload import Turn

    turns = [Turn(f"prompt {i}", 5 + i, 10 + i) for i in range(12)]
    args = sim_args("--predictions", "noisy-oracle", "--max-output-tokens", "64", "--tier-mix", "1,0,0")
    base, source = build_base_workload(args, turns)
    assert [r.max_tokens for r in base] == [64] * 12 and "noisy oracle" in source
    assert [r.output_tokens for r in base] == [t.output_tokens for t in turns]
    assert {r.tier for r in base} == {Tier.INTERACTIVE} and {r.arrival_time for r in base} == {0.0}


def test_the_simulate_report_gives_the_kv_budget_flags_and_cost_it_ran_with(tmp_path):
    from engine.config import REPO_ROOT
    from predictor.paths import SERVED_MODEL_REF
    from training.cli import main
    from training.sim_workload import load_test_turns

    model_config = json.loads((REPO_ROOT / SERVED_MODEL_REF / "config.json").read_text())
    head_dim = model_config["hidden_size"] // model_config["num_attention_heads"]
    kv_bytes = 2 * model_config["num_hidden_layers"] * model_config["num_key_value_heads"] * head_dim * 4  # K+V, fp32
    step_cost = tmp_path / "cost.json"
    step_cost.write_text(json.dumps({"a": 0.02, "b": 0.0005, "c": 2e-6, "d": 1e-4, "num_gpu_blocks": 100,
                                     "block_size": 16}))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--policies", "fcfs,sjf", "--num-requests", "30", "--predictions", "noisy-oracle",
                 "--no-plots", "--sweep-loads", "", "--kv-blocks", "300", "--block-size", "8",
                 "--preemption-mode", "swap", "--max-prompt-tokens", "512", "--max-output-tokens", "256",
                 "--step-cost", str(step_cost), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kv_budget"] == pytest.approx({"num_gpu_blocks": 300, "block_size": 8, "tokens": 2400,
                                                 "num_cpu_blocks": 150, "smollm2_fp32_gib": 2400 * kv_bytes / 2**30})
    assert report["cost_model"] == {"a_s": 0.02, "b_s_per_token": 0.0005, "c_s_per_context_token": 2e-6,
                                    "d_s_per_swapped_block": 1e-4, "source": f"calibrated ({step_cost})"}
    assert report["scheduler"]["max_model_len"] == 768 and report["scheduler"]["preemption_mode"] == "swap"
    assert report["sweep"] == [] and report["num_requests"] == 30
    assert report["policies"]["fcfs"]["num_served"] == 30
    # The load is the share of the saturated throughput: requests/s = load * tokens/s / tokens per request.
    replies = [turn.output_tokens for turn in load_test_turns(30, 0, 512, 256)]
    assert report["arrival_rate_per_s"] == pytest.approx(0.9 * report["saturated_output_tokens_per_s"]
                                                         / np.mean(replies))
    assert report["goals"]["aging_bound_s"] == report["policies"]["sjf"]["aging_bound_s"] > 0


def test_the_simulate_report_is_strict_json_and_leaves_unmeasured_goals_null(tmp_path):
    # With aging off every sjf bound is infinite, which json.dumps wrote as Infinity (no JSON);
    # without an oracle run the oracle-share goal read as missed; neither was measured.
    from training.cli import main

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    out = tmp_path / "sim.json"
    assert main(["simulate", "--policies", "fcfs,sjf", "--num-requests", "20", "--predictions", "noisy-oracle",
                 "--no-plots", "--sweep-loads", "", "--aging-tokens-per-s", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text(), parse_constant=refuse)
    goals = report["goals"]
    assert report["policies"]["sjf"]["aging_bound_s"] is None and goals["aging_bound_s"] is None
    assert goals["meets_wait_within_aging_bound"] is None and "aging is off" in goals["aging_note"]
    assert goals["meets_oracle_share_60pct"] is None and goals["meets_throughput_5pct"] is not None


def test_json_ready_nulls_what_json_has_no_word_for() -> None:
    from training.strict_json import json_ready

    value = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, "x"), "e": True}
    assert json_ready(value) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": True}


# ---- lengthwise bench engine

def test_each_system_counts_every_requests_own_max_tokens_in_a_mixed_batch(tiny_model_dir):
    # Lengths that differ inside one batch of 2: static batching runs each batch to its longest,
    # but only each request's own max_tokens is useful output.
    from engine.config import EngineConfig
    from training.engine_baselines import WorkItem, run_engine, run_hf_continuous, run_hf_static

    # The last prompt's prefill is split into chunks of at most 16 tokens: steps with no new token.
    items = [WorkItem(tuple(range(10, 10 + n)), m) for n, m in ((3, 2), (6, 5), (4, 3), (40, 2))]
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=2, num_gpu_blocks=64, block_size=16,
                          max_num_batched_tokens=16, num_threads=1, attention_backend="torch")
    engine = run_engine(items, config)
    assert engine.useful_tokens == 12 and len(engine.steps) >= 7  # 5 for the longest, 3 for the 40
    assert sum(step.num_batched_tokens for step in engine.steps) == 53 + 12 - 4  # prompts, then decodes
    # The share of the timed steps' time spent outside the forward (the warm-up step left out).
    forward, total = sum(s.forward_time_s for s in engine.steps), sum(s.step_time_s for s in engine.steps)
    assert engine.overhead_share == pytest.approx(1.0 - forward / total)
    assert run_hf_static(items, str(tiny_model_dir), 2, 0).useful_tokens == 12
    assert run_hf_continuous(items, str(tiny_model_dir), 2, 64, 1024).useful_tokens == 12


def test_the_engine_and_hf_baselines_run_past_a_model_end_token(tiny_model_dir, tmp_path):
    """The benchmark compares equal work: every system runs each request to its max_tokens, even
    where the model would end the reply. Here the model's end token is the one it produces first
    (named in generation_config.json, as SmolLM2's extra end ids are), so a system that stopped
    there would count one token, not four."""
    import shutil

    from engine.config import EngineConfig
    from engine.llm import LLM
    from scheduler.request import SamplingParams
    from training.engine_baselines import WorkItem, run_engine, run_hf_static

    prompt = [10, 11, 12]
    common = dict(max_num_seqs=2, num_gpu_blocks=64, block_size=16, num_threads=1, attention_backend="torch")
    first = LLM(config=EngineConfig(model=str(tiny_model_dir), **common)).generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0].token_ids[0]
    ending = tmp_path / "ends-at-once"
    shutil.copytree(tiny_model_dir, ending)
    (ending / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    stopped = LLM(config=EngineConfig(model=str(ending), **common)).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(stopped.token_ids) == 1 and stopped.finish_reason == "stop"  # the end token does end a reply
    items = [WorkItem(tuple(prompt), 4)]
    assert run_engine(items, EngineConfig(model=str(ending), max_num_batched_tokens=16, **common)).useful_tokens == 4
    assert run_hf_static(items, str(ending), 1, 0).useful_tokens == 4


def test_the_arrival_cv_bounds_are_inclusive():
    from training.simulate import arrival_cv

    assert arrival_cv("0.01") == 0.01 and arrival_cv("100") == 100.0
    for text in ("0.0099", "100.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            arrival_cv(text)


@pytest.mark.parametrize("blocks", [0, -4, "16", 2.5])
def test_a_step_cost_file_with_a_kv_budget_that_is_no_positive_count_is_refused(tmp_path, blocks):
    from training.simulate import load_cost_model

    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"a": 0.01, "b": 0.001, "c": 1e-6, "num_gpu_blocks": blocks}))
    with pytest.raises(ValueError, match="num_gpu_blocks must be a positive integer"):
        load_cost_model(path)
    path.write_text(json.dumps({"a": 0.01, "b": 0.001, "c": 1e-6, "num_gpu_blocks": 8, "block_size": blocks}))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        load_cost_model(path)


def test_the_simulator_keeps_at_most_max_kv_blocks_and_exactly_that_many():
    from training.simulate import MAX_KV_BLOCKS, scheduler_config

    assert scheduler_config(sim_args("--kv-blocks", str(MAX_KV_BLOCKS))).num_gpu_blocks == MAX_KV_BLOCKS
    with pytest.raises(ValueError, match="more than the simulator keeps"):
        scheduler_config(sim_args("--kv-blocks", str(MAX_KV_BLOCKS + 1)))


def test_a_simulation_that_finishes_in_exactly_max_steps_is_no_failure():
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate

    config, workload = SchedulerConfig(**SIM_CONFIG), sim_workload(6)
    steps = simulate(config, workload, COST).num_steps
    assert simulate(config, workload, COST, max_steps=steps).num_steps == steps
    with pytest.raises(RuntimeError, match=f"within {steps - 1} steps"):
        simulate(config, workload, COST, max_steps=steps - 1)


# ---- lengthwise (the command line)

def test_building_one_commands_parser_imports_no_other_commands_module():
    import subprocess
    import sys

    from engine.config import REPO_ROOT
    from training.cli import COMMANDS

    others = sorted(module for path, (module, _) in COMMANDS.items() if path != ("bench", "serve"))
    code = ("import sys; from training.cli import _build_parser; _build_parser(['bench', 'serve', '--help']); "
            f"print([m for m in {others!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_steps_of_one_time_fit_exactly_as_the_intercept():
    from engine.llm_engine import StepRecord
    from training.bench_engine import fit_step_cost

    steps = [StepRecord(tokens, 1, context, 0.02, 0.01) for tokens, context in ((1, 10), (8, 400), (64, 90))]
    fit = fit_step_cost(steps)
    assert fit["a"] == pytest.approx(0.02) and fit["b"] == pytest.approx(0.0, abs=1e-12)
    assert fit["r2"] == 1.0 and fit["num_steps"] == 3  # nothing left to explain: an exact fit


def test_summarise_gives_no_ratio_against_a_baseline_that_made_nothing_and_counts_the_steps():
    from engine.config import EngineConfig
    from engine.llm_engine import StepRecord
    from training.bench_engine import summarise
    from training.engine_baselines import RunResult

    steps = [StepRecord(4, 1, 4, 0.01, 0.005)] * 3
    results = {"engine": RunResult("engine", 30, 1.5, 0.5, steps), "hf_static": RunResult("hf_static", 0, 2.0),
               "hf_continuous": RunResult("hf_continuous", 30, 3.0)}
    summary = summarise(results, EngineConfig(), num_prompts=5)
    assert summary["ratio_vs_hf_static"] is None and summary["ratio_vs_hf_continuous"] == pytest.approx(2.0)
    assert (summary["engine_steps"], summary["num_prompts"]) == (3, 5)
    assert summary["useful_tokens"] == {"engine": 30, "hf_static": 0, "hf_continuous": 30}
    assert summary["seconds"] == {"engine": 1.5, "hf_static": 2.0, "hf_continuous": 3.0}


def test_bench_engine_refuses_a_context_one_token_too_short(tiny_model_dir, tmp_path, capsys):
    from training.cli import main

    assert main(["bench", "engine", "--model", str(tiny_model_dir), "--num-prompts", "1", "--threads", "1",
                 "--skip", "hf_static,hf_continuous", "--max-prompt-tokens", "300", "--max-output-tokens", "5",
                 "--max-model-len", "304", "--json", str(tmp_path / "b.json")]) == 2
    assert "exceed --max-model-len 304" in capsys.readouterr().err


def test_bench_engine_alone_with_its_flags_and_calibration(tiny_model_dir, tmp_path):
    from training.cli import main

    out, step_cost = tmp_path / "bench.json", tmp_path / "cost.json"
    assert main(["bench", "engine", "--model", str(tiny_model_dir), "--num-prompts", "2", "--max-prompt-tokens",
                 "300", "--max-output-tokens", "4", "--max-num-seqs", "2", "--threads", "1", "--block-size", "8",
                 "--kv-cache-memory", "0.001", "--skip", "hf_static,hf_continuous", "--no-retain-host-memory",
                 "--json", str(out), "--calibrate", "--step-cost-out", str(step_cost)]) == 0
    summary, fit = json.loads(out.read_text()), json.loads(step_cost.read_text())
    assert summary["tokens_per_s"]["hf_static"] is None and summary["tokens_per_s"]["hf_continuous"] is None
    assert set(summary["useful_tokens"]) == {"engine"}
    config = summary["config"]
    assert (config["retain_host_memory"], config["block_size"], config["kv_cache_memory_gib"]) == (False, 8, 0.001)
    # The KV budget in blocks of 8: K and V of every layer's KV heads, fp32, in 0.001 GiB.
    model = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    block_bytes = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * head_dim * 4 * 8
    assert (fit["num_gpu_blocks"], fit["block_size"]) == (int(0.001 * 2**30) // block_bytes, 8)
    assert fit["num_steps"] == summary["engine_steps"] >= 4 and fit["d"] > 0


def test_a_cost_model_whose_steps_overflow_gives_no_saturated_throughput():
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import StepCostModel
    from training.simulate import saturated_throughput

    huge = StepCostModel(a_s=1e308, b_s_per_token=0.0, c_s_per_context_token=0.0)  # the makespan overflows
    with pytest.raises(ValueError, match="not a usable cost model"):
        saturated_throughput(SchedulerConfig(**SIM_CONFIG), sim_workload(10), huge)


# ---- the simulator's workload

def test_load_test_turns_caps_replies_and_takes_each_turn_up_to_the_prompt_cap_once_per_draw():
    from training.sim_workload import load_test_turns

    table = pd.read_parquet(TEST_TABLE)
    prompt_cap = int(table.prompt_tokens.quantile(0.2))  # a length some prompt has exactly
    pool = table[(table.prompt_tokens <= prompt_cap) & (table.response_tokens >= 1)]
    assert (pool.prompt_tokens == prompt_cap).any()
    expected = Counter(zip(pool.prompt, pool.prompt_tokens, pool.response_tokens.clip(upper=50)))
    turns = load_test_turns(len(pool), 0, prompt_cap, 50)
    assert Counter((t.prompt, t.prompt_tokens, t.output_tokens) for t in turns) == expected
    more = load_test_turns(len(pool) + 50, 0, prompt_cap, 50)  # more than the pool: drawn with replacement
    assert len(more) == len(pool) + 50 and len({t.prompt for t in more}) > len(pool) / 2
    assert all((t.prompt, t.prompt_tokens, t.output_tokens) in expected for t in more)
    first, again, other = (load_test_turns(20, seed, 1024, 1024) for seed in (1, 1, 2))
    assert first == again and first != other


def test_the_noisy_oracle_is_lognormal_about_the_true_length_with_its_90th_percentile():
    from scipy.stats import norm

    from training.sim_workload import NOISY_ORACLE_SIGMA, Turn, noisy_oracle

    predictions = noisy_oracle([Turn("p", 5, 100)] * 4000, seed=0)
    logs = np.log([p.point / 100 for p in predictions])
    assert abs(logs.mean()) < 0.05 and logs.std() == pytest.approx(NOISY_ORACLE_SIGMA, rel=0.05)
    ratio = np.exp(norm.ppf(0.9) * NOISY_ORACLE_SIGMA)
    assert all(p.p90 == pytest.approx(p.point * ratio) and p.p50 == p.point == p.rank_len for p in predictions)
    assert min(p.point for p in noisy_oracle([Turn("p", 5, 1)] * 200, seed=0)) == 1.0  # never below a token


def test_build_workload_carries_each_prediction_to_its_field_at_least_one_token():
    from scheduler.request import Tier
    from training.sim_workload import Predicted, Turn, assign_tiers, build_workload

    turns = [Turn("a", 5, 7), Turn("b", 6, 2)]
    predictions = [Predicted(3.0, 4.0, 9.0, 5.0), Predicted(0.2, 0.3, 0.5, 0.1)]
    first, second = build_workload(turns, predictions, [0.5, 1.5], [Tier.BATCH, Tier.STANDARD], max_tokens=32)
    assert (first.predicted_len, first.predicted_p50, first.predicted_p90, first.predicted_rank_len) == (3, 4, 9, 5)
    assert (second.predicted_len, second.predicted_p50, second.predicted_p90, second.predicted_rank_len) == (1, 1, 1, 1)
    assert (first.arrival_time, first.tier, first.max_tokens, first.output_tokens) == (0.5, Tier.BATCH, 32, 7)
    assert set(assign_tiers(50, (0, 0, 1), 0)) == {Tier.BATCH}
    assert set(assign_tiers(50, (1, 0, 0), 0)) == {Tier.INTERACTIVE}


def test_cached_predictions_keep_every_head_of_a_predictor_whose_ranking_length_is_not_its_point(tmp_path):
    # The length baseline's ranking length is its point, so a cache that stored one for the other
    # passed test_simulator's cache test; the committed lexical predictor ranks by its p50 head.
    import predictor
    from engine.config import REPO_ROOT
    from training.sim_workload import Turn, predictor_predictions

    folder = REPO_ROOT / "data" / "predictors" / "lexical"
    prompts = ["Write an essay on the history of Rome.", "yes or no: is water wet?", "Translate 'cat' to French",
               "List ten fruits", "hi"]
    expected = predictor.load(folder).predict(prompts)
    assert any(p.rank_len != pytest.approx(p.point) for p in expected)  # else this shows nothing
    for _ in range(2):  # computed, then read back from the cache file
        got = predictor_predictions([Turn(prompt, 3, 10) for prompt in prompts], folder, cache_dir=tmp_path)
        assert [(g.point, g.p50, g.p90, g.rank_len) for g in got] == [
            pytest.approx((p.point, p.p50, p.p90, p.rank_len)) for p in expected]


def test_the_prediction_cache_follows_a_renamed_file_with_the_same_bytes(tmp_path):
    # A predictor reads its files by name: one whose heads.json was renamed away predicts with its
    # default heads, though every byte in the folder is the same, so the old cache must not be read.
    from training.sim_workload import _cache_path

    folder = tmp_path / "predictor"
    folder.mkdir()
    (folder / "heads.json").write_text('{"rank_len": "p50"}')
    before = _cache_path(folder, tmp_path)
    (folder / "heads.json").rename(folder / "heads.json.off")
    assert _cache_path(folder, tmp_path) != before


def test_simulate_refuses_a_folder_that_is_no_predictor_before_reading_anything_else(tmp_path, capsys):
    # A wrong --predictor is the first thing said, before the step cost and the turn table are
    # read, not found after the workload has loaded.
    from training.cli import main

    bad_cost = tmp_path / "cost.json"
    bad_cost.write_text("not json")
    assert main(["simulate", "--predictor", str(tmp_path), "--step-cost", str(bad_cost),
                 "--json", str(tmp_path / "s.json")]) == 2
    assert "not a saved predictor folder" in capsys.readouterr().err
