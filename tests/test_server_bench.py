"""`lengthwise bench serve`: arrivals, goodput and summaries, and a short real load on a tiny server."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.server.app import ServerSettings, create_app
from test_server import MODEL, running_server, tiny_engine
from training import bench_serve
from training.bench_serve_report import RequestResult, meets_slos, parse_goodput, summarize


def bench_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_poisson_arrivals_have_the_asked_rate_and_inf_sends_at_once():
    offsets = bench_serve.arrival_offsets(4000, rate=8.0, burstiness=1.0, seed=1)
    gaps = np.diff(offsets)
    assert np.all(gaps >= 0) and offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(bench_serve.arrival_offsets(4000, rate=8.0, burstiness=0.25, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # gamma: CV 1/sqrt(shape)
    assert bench_serve.arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    # What a schedule really offers: close to the rate over many requests, off by seed over few
    # (the README's issue-6 workload: 200 requests at rate 1, seed 0).
    assert bench_serve.offered_rate(offsets) == pytest.approx(8.0, rel=0.05)
    assert bench_serve.offered_rate(bench_serve.arrival_offsets(200, 1.0, 1.0, 0)) == pytest.approx(0.884, abs=0.001)
    assert bench_serve.offered_rate([0.0, 0.0, 0.0]) is None


def test_a_reply_cap_shortens_the_same_requests_instead_of_choosing_others():
    uncapped = bench_serve.sample_workload(bench_args(num_prompts=40, max_model_len=1024))
    capped = bench_serve.sample_workload(bench_args(num_prompts=40, max_model_len=1024, max_output_tokens=64))
    assert [item.prompt for item in capped] == [item.prompt for item in uncapped]
    assert [item.max_tokens for item in capped] == [min(item.max_tokens, 64) for item in uncapped]
    assert any(item.max_tokens > 64 for item in uncapped)  # the cap did bind
    assert all(item.prompt_tokens + item.max_tokens <= 1024 for item in uncapped)


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_goodput(["ttft:2000", "e2el:30000"])
    assert slos == {"ttft": 2.0, "e2el": 30.0}
    fast = RequestResult(0, "standard", 10, 5, 0.0, success=True, output_tokens=5, ttft_s=0.5, e2e_s=3.0)
    slow_start = RequestResult(1, "standard", 10, 5, 0.0, success=True, output_tokens=5, ttft_s=2.5, e2e_s=3.0)
    failed = RequestResult(2, "batch", 10, 5, 0.0, success=False, status=429, error="HTTP 429")
    assert meets_slos(fast, slos) and not meets_slos(slow_start, slos)
    summary = summarize([fast, slow_start, failed], duration_s=2.0, slos=slos)
    assert (summary["completed"], summary["failed"], summary["rejected_429"]) == (2, 1, 1)
    assert summary["goodput_rps"] == pytest.approx(0.5)
    assert summary["mean_ttft_s"] == pytest.approx(1.5) and summary["mean_e2e_s"] == pytest.approx(3.0)
    assert fast.tpot_s == pytest.approx((3.0 - 0.5) / 4)
    assert set(summary["per_tier"]) == {"standard", "batch"}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_tier_mix_parsing():
    assert bench_serve.parse_tier_mix("interactive:1,batch:3") == {"interactive": 1.0, "batch": 3.0}
    assert bench_serve.parse_tier_mix(None) == {"standard": 1.0}
    with pytest.raises(ValueError):
        bench_serve.parse_tier_mix("gold:1")


def test_a_broken_stream_fails_its_request_not_the_run():
    # A server answering in ways vLLM's benchmark counts as failures: each request is marked
    # failed with a reason, and nothing escapes to abort the other requests' results.
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    import httpx

    # A line ends at "\r\n", "\n" or "\r" only (a "\r\n" split across reads too): U+2028,
    # U+2029 and U+0085 may stand raw inside JSON, as vLLM sends them, and a chunk split across
    # reads is one line.
    separators = '{"choices": [{"text": "a\u2028b\u2029c\x85d"}]}'
    streams = {"malformed": ["data: {not json\n\n"], "no text": ["data: [DONE]\n\n"],
               "separators": ["data: " + separators[:20], separators[20:] + "\r", "\n\r",
                              'data: {"choices": [], "usage": {"completion_tokens": 1}}\r\rdata: [DONE]'],
               "no usage": ['data: {"choices": [{"text": "hi"}]}\n\n', "data: [DONE]\n\n"],
               "error field": ['data: {"error": "boom"}\n\n', "data: [DONE]\n\n"],
               # Not a failure: a reply that is only its end-of-sequence token (empty text), as
               # vLLM's benchmark counts it.
               "eos only": ['data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\n',
                            'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n', "data: [DONE]\n\n"],
               # Not a failure either: an error key set to null reports no error.
               "null error": ['data: {"choices": [{"text": "hi"}], "error": null}\n\n',
                              'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n', "data: [DONE]\n\n"],
               "null usage count": ['data: {"choices": [{"text": "hi"}]}\n\n',
                                    'data: {"choices": [], "usage": {"completion_tokens": null}}\n\n',
                                    "data: [DONE]\n\n"]}
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(payload: dict):
        return StreamingResponse(iter(streams[payload["prompt"]]), media_type="text/event-stream")

    async def send_all(base_url: str):
        results = {}
        async with httpx.AsyncClient() as client:
            for name in streams:
                results[name] = RequestResult(0, "standard", 1, 4, 0.0)
                await bench_serve.send_one(client, f"{base_url}/v1/completions", {"prompt": name}, results[name])
        return results

    with running_server(app) as (base_url, _):  # a real socket, as a server streams
        results = asyncio.run(send_all(base_url))
    separated = results.pop("separators")
    assert separated.success and separated.output_tokens == 1, separated.error
    eos_only = results.pop("eos only")
    assert eos_only.success and eos_only.ttft_s is not None and eos_only.output_tokens == 1, eos_only.error
    null_error = results.pop("null error")
    assert null_error.success and null_error.output_tokens == 1, null_error.error
    assert not any(r.success for r in results.values())
    assert all(r.error for r in results.values()), {name: r.error for name, r in results.items()}
    assert results["error field"].error == "stream error: boom"
    assert results["no text"].error == "no token received" and "usage" in results["no usage"].error
    assert "usage" in results["null usage count"].error


def test_load_against_a_tiny_server_completes_every_request(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    settings = ServerSettings(model_name=MODEL, max_model_len=1024, info=(("policy", "sjf"),))
    app = create_app(AsyncLLMEngine(engine), engine.tokenizer, settings)
    items = [bench_serve.WorkItem(i, f"Question {i}: why?", 6, 4 + i, tier)
             for i, tier in enumerate(["interactive", "standard", "batch", "standard"])]
    with running_server(app) as (base_url, _):
        args = bench_args(base_url=base_url, request_rate=50.0, ignore_eos=True)
        offsets = bench_serve.arrival_offsets(len(items), args.request_rate, args.burstiness, args.seed)
        results, duration = asyncio.run(bench_serve.run_load(args, items, MODEL, offsets))
        info, preemptions = bench_serve.server_state(base_url)
    assert info["policy"] == "sjf" and preemptions == 0
    assert all(r.success and r.error == "" for r in results)
    assert [r.output_tokens for r in results] == [item.max_tokens for item in items]
    assert all(0 < r.ttft_s <= r.e2e_s for r in results)
    # One gap per chunk after the first: a lagging reader may get several tokens in one chunk.
    assert all(len(r.itl_s) <= r.output_tokens - 1 for r in results)
    summary = summarize(results, duration, parse_goodput(["e2el:3600000"]))
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["goodput_rps"] == pytest.approx(summary["request_throughput_rps"])
    assert summary["output_tokens_per_s"] == pytest.approx(sum(i.max_tokens for i in items) / duration)



def test_bench_serve_run_lands_in_the_sqlite_store_with_artifacts_under_it(tmp_path, monkeypatch):
    import mlflow

    from training import bench_serve_report, tracking

    store = tmp_path / "mlruns"
    monkeypatch.setattr(tracking, "default_store", lambda: store)
    result = tmp_path / "fcfs.json"
    result.write_text("{}")
    run_id = bench_serve_report.log_to_mlflow({"completed": 3, "mean_e2e_s": 1.5}, {"policy": "fcfs"},
                                              [result], "fcfs")
    run = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(store)).get_run(run_id)
    assert run.data.metrics == {"completed": 3.0, "mean_e2e_s": 1.5}
    assert run.info.artifact_uri.startswith((store / "artifacts").resolve().as_uri())
    assert (store / "mlflow.db").exists()


def _run(rejected: int, answered: list[int], mean_e2e: float, tokens_per_s: float, **config) -> dict:
    workload = {"model": "m", "num_prompts": 4, "request_rate": float("inf"), "seed": 0, **config}
    return {"config": workload, "rejected_429": rejected, "failed": rejected, "mean_e2e_s": mean_e2e,
            "output_tokens_per_s": tokens_per_s,
            "requests": [{"index": i, "success": i in answered} for i in range(4)]}


def test_a_run_compares_with_its_baseline_only_on_the_same_work_and_answers(tmp_path):
    from training.bench_serve_compare import compare

    fcfs = _run(0, [0, 1, 2, 3], mean_e2e=30.0, tokens_per_s=80.0, label="fcfs")
    sjf = _run(0, [0, 1, 2, 3], mean_e2e=20.0, tokens_per_s=100.0)
    result = compare(sjf, sjf["config"], sjf["requests"], fcfs, tmp_path / "fcfs.json")
    assert result["comparable"] and result["not_comparable_reasons"] == [] and result["baseline_label"] == "fcfs"
    assert result["ratios"]["mean_e2e_s_baseline_over_this"] == pytest.approx(1.5)
    assert result["ratios"]["output_tokens_per_s_this_over_baseline"] == pytest.approx(1.25)
    assert result["ratios"]["p99_e2e_s_baseline_over_this"] is None  # absent from both: no ratio

    # Faster by turning requests away: ratios still given, but flagged with every reason.
    shed = _run(1, [0, 1, 2], mean_e2e=10.0, tokens_per_s=100.0, seed=1)
    result = compare(shed, shed["config"], shed["requests"], fcfs, tmp_path / "fcfs.json")
    assert not result["comparable"] and result["ratios"]["mean_e2e_s_baseline_over_this"] == pytest.approx(3.0)
    reasons = " | ".join(result["not_comparable_reasons"])
    assert "seed: baseline 0, this run 1" in reasons and "rejected_429: baseline 0, this run 1" in reasons
    assert "answered requests differ: 1 only in the baseline, 0 only in this run" in reasons


# What `bench serve` takes that leaves the work offered as it is: where it goes, what the run is named,
# how long a client waits (a timeout that bites shows as failures, compared on their own).
NOT_WORKLOAD_FLAGS = {"base_url", "request_timeout", "api_key", "label", "baseline", "result_dir", "no_mlflow"}


def test_every_flag_that_shapes_the_work_must_match_for_a_comparison(tmp_path):
    from training.bench_serve_compare import WORKLOAD_KEYS, compare

    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    workload_flags = {action.dest for action in parser._actions} - {"help"} - NOT_WORKLOAD_FLAGS
    assert set(WORKLOAD_KEYS) == workload_flags  # a new flag is named here as work or not
    fcfs = _run(0, [0, 1, 2, 3], mean_e2e=30.0, tokens_per_s=80.0, **vars(bench_args()))
    for key in sorted(workload_flags):
        config = {**fcfs["config"], key: "changed"}
        reasons = compare(fcfs, config, fcfs["requests"], fcfs, tmp_path / "fcfs.json")["not_comparable_reasons"]
        assert [reason.split(":")[0] for reason in reasons] == [key]


def test_the_same_counts_of_other_answers_or_failures_are_not_comparable(tmp_path):
    from training.bench_serve_compare import compare

    fcfs = _run(1, [0, 1, 2], mean_e2e=30.0, tokens_per_s=80.0)
    other = _run(1, [1, 2, 3], mean_e2e=20.0, tokens_per_s=80.0)  # as many answered, not the same ones
    reasons = compare(other, other["config"], other["requests"], fcfs, tmp_path / "f.json")["not_comparable_reasons"]
    assert reasons == ["answered requests differ: 1 only in the baseline, 1 only in this run"]
    broken = {**fcfs, "failed": 2}  # one more failure that is no 429, the answered set unchanged
    reasons = compare(broken, broken["config"], broken["requests"], fcfs, tmp_path / "f.json")["not_comparable_reasons"]
    assert reasons == ["failed: baseline 1, this run 2"]


def test_each_ratio_reads_better_above_one_and_a_zero_baseline_gives_none(tmp_path):
    from training.bench_serve_compare import compare

    latencies = {"mean_e2e_s": 30.0, "p50_e2e_s": 20.0, "p99_e2e_s": 90.0, "mean_ttft_s": 3.0, "p99_ttft_s": 12.0}
    fcfs = {**_run(0, [0, 1, 2, 3], mean_e2e=30.0, tokens_per_s=80.0), **latencies, "goodput_rps": 0.0}
    sjf = {**fcfs, "mean_e2e_s": 20.0, "p50_e2e_s": 10.0, "p99_e2e_s": 120.0, "mean_ttft_s": 2.0,
           "p99_ttft_s": 16.0, "output_tokens_per_s": 76.0, "goodput_rps": 0.5}
    ratios = compare(sjf, sjf["config"], sjf["requests"], fcfs, tmp_path / "fcfs.json")["ratios"]
    assert ratios == pytest.approx({
        "mean_e2e_s_baseline_over_this": 1.5, "p50_e2e_s_baseline_over_this": 2.0,
        "p99_e2e_s_baseline_over_this": 0.75, "mean_ttft_s_baseline_over_this": 1.5,
        "p99_ttft_s_baseline_over_this": 0.75, "output_tokens_per_s_this_over_baseline": 0.95,
        "goodput_rps_this_over_baseline": None})  # no request met the SLOs under the baseline
    back = compare(fcfs, fcfs["config"], fcfs["requests"], sjf, tmp_path / "sjf.json")["ratios"]
    assert back["goodput_rps_this_over_baseline"] == 0.0


def test_a_baseline_written_by_a_run_reads_back_comparable_with_an_unbounded_rate(tmp_path):
    # An `inf` request rate goes to JSON as vLLM's "inf": it must read back equal, or every
    # all-at-once pair would be flagged not comparable.
    from training.bench_serve_compare import compare, load_baseline
    from training.bench_serve_report import write_json

    results = [RequestResult(i, "standard", 5, 4, 0.0, success=True, status=200, output_tokens=4, ttft_s=0.1,
                             e2e_s=1.0) for i in range(3)]
    config = {"model": "m", "num_prompts": 3, "request_rate": float("inf"), "burstiness": float("inf"), "seed": 0,
              "tier_mix": None, "goodput": ["e2el:30000"], "label": "fcfs"}
    summary = {"completed": 3, "failed": 0, "rejected_429": 0, "mean_e2e_s": 1.0}
    write_json(tmp_path / "fcfs.json", summary, config, results)
    baseline = load_baseline(tmp_path / "fcfs.json")
    assert (baseline["config"]["request_rate"], baseline["config"]["burstiness"]) == ("inf", "inf")
    requests = [{"index": r.index, "success": r.success} for r in results]
    result = compare({**summary, "mean_e2e_s": 0.5}, dict(config), requests, baseline, tmp_path / "fcfs.json")
    assert result["comparable"], result["not_comparable_reasons"]
    assert result["ratios"]["mean_e2e_s_baseline_over_this"] == pytest.approx(2.0)
    other_slo = compare(summary, {**config, "goodput": ["e2el:10000"]}, requests, baseline, tmp_path / "fcfs.json")
    assert not other_slo["comparable"] and other_slo["not_comparable_reasons"][0].startswith("goodput:")
    # The same SLOs in another order or spelling are the same experiment.
    reordered = compare(summary, {**config, "goodput": ["e2el:30000.0"]}, requests, baseline, tmp_path / "fcfs.json")
    assert reordered["comparable"], reordered["not_comparable_reasons"]
    # A baseline from before session 32 wrote the rate as Infinity (json.loads reads it as inf).
    old = {**baseline, "config": {**baseline["config"], "request_rate": float("inf")}}
    assert compare(summary, dict(config), requests, old, tmp_path / "fcfs.json")["comparable"]


def test_goodput_given_twice_keeps_both_groups() -> None:
    import argparse

    from training.bench_serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--goodput", "ttft:2000", "--goodput", "e2el:30000", "tpot:100"])
    assert parse_goodput(args.goodput) == {"ttft": 2.0, "e2el": 30.0, "tpot": 0.1}


def test_the_bench_serve_command_writes_its_json_plot_and_mlflow_run(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # The whole command against a real server: ShareGPT prompts sampled, every reply exactly its
    # max_tokens (--ignore-eos), and the JSON, the plot and the MLflow run with both as artifacts.
    import json

    import mlflow

    from training import tracking
    from training.cli import main

    store = tmp_path / "mlruns"
    monkeypatch.setattr(tracking, "default_store", lambda: store)
    engine = tiny_engine(tiny_model_dir)
    app = create_app(AsyncLLMEngine(engine), engine.tokenizer,
                     ServerSettings(model_name=MODEL, max_model_len=1024, info=(("policy", "fcfs"),)))
    with running_server(app) as (base_url, _):
        assert main(["bench", "serve", "--base-url", base_url, "--num-prompts", "3", "--request-rate", "inf",
                     "--ignore-eos", "--max-output-tokens", "3", "--max-model-len", "200",
                     "--goodput", "e2el:3600000", "--result-dir", str(tmp_path / "runs")]) == 0
    result = json.loads((tmp_path / "runs" / "fcfs-rateinf.json").read_text())
    required = ("completed", "failed", "mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "p99_ttft_s", "goodput_rps",
                "output_tokens_per_s")
    assert all(result[key] is not None for key in required)
    assert (result["completed"], result["failed"], result["short_outputs"]) == (3, 0, 0)
    assert result["config"]["server_policy"] == "fcfs" and len(result["requests"]) == 3
    assert (tmp_path / "runs" / "fcfs-rateinf.png").stat().st_size > 0
    run_id = capsys.readouterr().out.split("MLflow run ")[1].split()[0]
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(store))
    assert client.get_run(run_id).data.metrics["completed"] == 3.0
    assert {a.path for a in client.list_artifacts(run_id)} == {"fcfs-rateinf.json", "fcfs-rateinf.png"}
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks


def test_the_printed_summary_names_short_replies_preemptions_and_the_offered_rate(capsys) -> None:
    # They were in the JSON alone: a run with short replies under --ignore-eos printed "failed: 0".
    from training.bench_serve_report import print_summary

    print_summary({"completed": 2, "failed": 0, "short_outputs": 1, "server_preemptions": 4.0,
                   "offered_request_rate_rps": 0.884, "no_response": 0}, "fcfs")
    out = capsys.readouterr().out
    for line in ("short_outputs: 1", "server_preemptions: 4", "offered_request_rate_rps: 0.884", "no_response: 0"):
        assert line in out, line
    print_summary({"completed": 2, "failed": 0}, "fcfs")
    assert "short_outputs" not in capsys.readouterr().out  # only with --ignore-eos


@pytest.mark.parametrize("change, reason", [
    ({"requests": [1]}, "requests are not a list"), ({"config": []}, "config is not an object"),
    ({"mean_e2e_s": "1.0"}, "mean_e2e_s is '1.0', not a number"),
    ({"requests": [{"index": 0, "success": 1}]}, "requests are not a list"),
    ({"requests": [{"index": 0, "success": True, "output_tokens": "4"}]}, "requests are not a list")])
def test_a_baseline_the_comparison_could_not_read_is_refused_before_the_load(tmp_path, change, reason):
    # Found only by the comparison, after the whole load, it lost the run's JSON to a traceback.
    from training.bench_serve_compare import load_baseline

    path = tmp_path / "fcfs.json"
    path.write_text(json.dumps({**_run(0, [0, 1], mean_e2e=3.0, tokens_per_s=8.0), **change}))
    with pytest.raises(ValueError, match=reason):
        load_baseline(path)


def test_replies_of_another_length_and_the_default_tier_mix_spelled_out(tmp_path):
    from training.bench_serve_compare import compare

    fcfs = _run(0, [0, 1, 2], mean_e2e=30.0, tokens_per_s=80.0, tier_mix=None, ignore_eos=True)
    for request in fcfs["requests"]:
        request["output_tokens"] = 10
    short = [{**request, "output_tokens": 7 if request["index"] < 2 else 10} for request in fcfs["requests"]]
    reasons = compare(fcfs, fcfs["config"], short, fcfs, tmp_path / "f.json")["not_comparable_reasons"]
    assert reasons == ["output tokens differ on 2 requests answered in both"]
    # Stopping on their own, replies may end elsewhere in each run: that alone is no reason.
    natural = {**fcfs, "config": {**fcfs["config"], "ignore_eos": False}}
    assert compare(natural, natural["config"], short, natural, tmp_path / "f.json")["comparable"]
    # Unset is standard:1, the same workload; a mix in another order draws other tiers.
    spelled = {**fcfs["config"], "tier_mix": "standard:1.0"}
    assert compare(fcfs, spelled, fcfs["requests"], fcfs, tmp_path / "f.json")["comparable"]
    mixed = {**fcfs, "config": {**fcfs["config"], "tier_mix": "interactive:1,batch:1"}}
    swapped = {**fcfs["config"], "tier_mix": "batch:1,interactive:1"}
    assert not compare(fcfs, swapped, fcfs["requests"], mixed, tmp_path / "f.json")["comparable"]


def test_an_unbounded_burstiness_spaces_arrivals_evenly_as_vllm_reads_it():
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    assert parser.parse_args(["--base-url", "http://x", "--burstiness", "inf"]).burstiness == float("inf")
    for bad in ("nan", "0", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--base-url", "http://x", "--burstiness", bad])
    offsets = bench_serve.arrival_offsets(5, 2.0, float("inf"), seed=0)
    assert offsets == [0.0, 0.5, 1.0, 1.5, 2.0] and bench_serve.offered_rate(offsets) == 2.0
