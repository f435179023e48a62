"""`lengthwise bench serve`: an open-loop load generator against a running OpenAI-compatible server.

Workload: ShareGPT turns of one split (the chat-templated prompt text, sent to /v1/completions so
the server and its predictor see exactly the dataset's prompt), filtered to fit the context,
sampled with a seed. `max_tokens` is the dataset's reply length (optionally capped); with
--ignore-eos every reply runs to it, otherwise the model may stop earlier. The filter reads the
uncapped reply length, so a cap shortens the same requests rather than choosing others: runs with
and without --max-output-tokens (or with different caps) serve the same prompts.

Arrivals are open-loop: inter-arrival gaps drawn from a gamma distribution with shape
--burstiness (1 = Poisson; inf = evenly spaced, as vLLM reads it) and mean 1 / --request-rate;
a rate of `inf` sends everything at once. Each
request streams (SSE with usage) and is timed by the client; see bench_serve_report.py for the
statistics. Results: a JSON file and a plot under --result-dir, and an MLflow run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from engine.arg_types import (api_key, api_key_or_environment, checked_by, file_stem, non_negative_float,
                              non_negative_int, positive_float, positive_int, positive_rate, prepare_output_dir)
from engine.config import REPO_ROOT
from training import bench_serve_compare
from training import bench_serve_report as report
from training import tracking
from training.bench_serve_report import TIER_TO_SERVICE_TIER, parse_tier_mix


@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int
    tier: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--num-prompts", type=positive_int, default=200)
    parser.add_argument("--request-rate", type=positive_rate, default=float("inf"), help="requests/s; inf = all at once")
    parser.add_argument("--burstiness", type=positive_rate, default=1.0,
                        help="gamma shape; 1 = Poisson arrivals, inf = evenly spaced ones")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
    parser.add_argument("--tier-mix", type=checked_by(parse_tier_mix, "tier mix"), default=None,
                        help="e.g. interactive:0.2,standard:0.6,batch:0.2")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    parser.add_argument("--max-output-tokens", type=positive_int, default=None,
                        help="cap on the dataset's reply length (the same prompts are chosen with or without it)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048, help="drop turns longer than this")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    # "+" and "extend", so that the flag without values is an error and given twice keeps both groups
    # (parse_goodput refuses a key given twice).
    parser.add_argument("--goodput", nargs="+", action="extend",
                        type=checked_by(lambda item: report.parse_goodput([item]), "SLO"),
                        default=None, metavar="KEY:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="cap on requests in flight")
    parser.add_argument("--request-timeout", type=positive_float, default=1800.0, metavar="S",
                        help="longest wait for the server's next bytes (the first token's included), not a "
                             "limit on the whole request")
    parser.add_argument("--api-key", type=api_key, default=None,
                        help="the server's key (default: $LENGTHWISE_API_KEY, else $VLLM_API_KEY, else none)")
    parser.add_argument("--label", type=file_stem, default=None, help="run name (e.g. the server's policy)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="RUN.json",
                        help="an earlier run's JSON (e.g. the fcfs server's): report ratios against it, "
                             "and whether the two runs are comparable")
    parser.add_argument("--result-dir", default=str(REPO_ROOT / "out" / "bench_serve"))
    parser.add_argument("--no-mlflow", action="store_true")


def sample_workload(args: argparse.Namespace) -> list[WorkItem]:
    from training.dataset import load_turns

    table = load_turns(args.split).select_columns(["prompt", "prompt_tokens", "response_tokens"])
    prompt_lens, reply_lens = table["prompt_tokens"], table["response_tokens"]
    fits = [i for i, (p, r) in enumerate(zip(prompt_lens, reply_lens))
            if p >= 4 and r >= 4 and p + r <= args.max_model_len]
    if len(fits) < args.num_prompts:
        raise ValueError(f"--num-prompts {args.num_prompts}: only {len(fits)} {args.split} turns fit "
                         f"--max-model-len {args.max_model_len}")
    rng = random.Random(args.seed)
    chosen = rng.sample(fits, args.num_prompts)
    mix = parse_tier_mix(args.tier_mix)
    tiers = rng.choices(list(mix), weights=list(mix.values()), k=len(chosen))
    rows = table.select(chosen)
    items = []
    for index, (row, tier) in enumerate(zip(rows, tiers)):
        max_tokens = row["response_tokens"]
        if args.max_output_tokens is not None:
            max_tokens = min(max_tokens, args.max_output_tokens)
        items.append(WorkItem(index, row["prompt"], row["prompt_tokens"], max_tokens, tier))
    return items


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s) of n requests: cumulative gamma gaps with mean 1/rate; zeros when rate is
    inf; gaps of exactly 1/rate when burstiness is (a gamma whose shape grows without bound)."""
    if np.isinf(rate):
        return [0.0] * n
    if np.isinf(burstiness):
        return [index / rate for index in range(n)]
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))


def offered_rate(offsets: list[float]) -> float | None:
    """Requests per second the schedule actually offers: the gaps are drawn, not rescaled (as in
    vLLM's older benchmark_serving.py), so one seed's schedule runs faster or slower than
    --request-rate (seed 0 at rate 1 for 200 requests: 0.88). None when all are sent at once."""
    if len(offsets) < 2 or offsets[-1] <= 0:
        return None
    return (len(offsets) - 1) / offsets[-1]


async def send_one(client: httpx.AsyncClient, url: str, payload: dict, result: report.RequestResult) -> None:
    """Stream one completion, filling `result` with its timings or its error."""
    sent = time.perf_counter()
    last_chunk = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            result.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    # As vLLM's benchmark: the request ends with its last chunk of choices (the
                    # usage chunk and [DONE] follow at once, carrying no token).
                    result.e2e_s = (last_chunk if last_chunk is not None else time.perf_counter()) - sent
                    result.success = _completed(result)
                    return
                if _on_chunk(json.loads(data), result, sent):
                    now = time.perf_counter()
                    if last_chunk is not None:
                        result.itl_s.append(now - last_chunk)
                    last_chunk = now
            result.error = result.error or "stream ended without [DONE]"  # an error event's reason first
    except Exception as exc:  # noqa: BLE001 - a broken stream fails this request, never the whole run
        result.error = f"{type(exc).__name__}: {exc}"


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, ended by "\r\n", "\n" or "\r" only, as server-sent events end them.
    httpx's aiter_lines also splits at U+2028, U+2029 and U+0085, which a server may leave raw
    inside its JSON (vLLM, SGLang and OpenAI do): a token holding one failed its request."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        held = "\r" if pending.endswith("\r") else ""  # maybe the first half of a "\r\n"
        *lines, rest = _one_line_end(pending[:len(pending) - len(held)]).split("\n")
        pending = rest + held
        for line in lines:
            yield line
    for line in _one_line_end(pending).split("\n"):
        if line:
            yield line


def _one_line_end(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _completed(result: report.RequestResult) -> bool:
    """Success: no error, and at least one token came back, as `vllm bench serve` requires; and a
    usage count, which vLLM's benchmark would recompute from the text, but which this server always
    sends when asked (`stream_options.include_usage`), so its absence means a broken stream."""
    if result.error:
        return False
    if result.ttft_s is None or result.output_tokens <= 0:
        result.error = "no token received" if result.ttft_s is None else "no usage count in the stream"
        return False
    return True


def _on_chunk(chunk: dict, result: report.RequestResult, sent: float) -> bool:
    """Record what one SSE chunk says; True when it carried choices (a token arrived). As in vLLM's
    benchmark, a choice with empty text counts: a reply's end-of-sequence token arrives as one."""
    error = chunk.get("error")
    if error is not None:  # a key set to null reports no error
        result.error = f"stream error: {error.get('message', '') if isinstance(error, dict) else error}"
        return False
    choices = chunk.get("choices") or []
    if choices and result.ttft_s is None:
        result.ttft_s = time.perf_counter() - sent
    if any(choice.get("finish_reason") == "abort" for choice in choices):
        result.error = "aborted by the server"
    if chunk.get("usage"):
        # A null count is none: _completed then names the missing count (a TypeError did).
        result.output_tokens = chunk["usage"].get("completion_tokens") or 0
    return bool(choices)


async def run_load(args: argparse.Namespace, items: list[WorkItem], model: str,
                   offsets: list[float]) -> tuple[list, float]:
    """Send each item at its offset (s from the start); returns the results and the duration."""
    limit = asyncio.Semaphore(args.max_concurrency or len(items))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    url = args.base_url.rstrip("/") + "/v1/completions"
    results = [report.RequestResult(i.index, i.tier, i.prompt_tokens, i.max_tokens, offset)
               for i, offset in zip(items, offsets)]
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def one(item: WorkItem, result: report.RequestResult) -> None:
            await asyncio.sleep(max(0.0, start + result.start_s - time.perf_counter()))
            async with limit:
                result.start_s = time.perf_counter() - start
                await send_one(client, url, _payload(args, item, model), result)

        await asyncio.gather(*(one(item, result) for item, result in zip(items, results)))
        return results, time.perf_counter() - start


def _payload(args: argparse.Namespace, item: WorkItem, model: str) -> dict:
    payload = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, "temperature": args.temperature}
    # Only what was asked for, as vLLM's client sends them: an OpenAI endpoint that validates
    # strictly refuses ignore_eos, even false.
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if args.tier_mix is not None:
        payload["service_tier"] = TIER_TO_SERVICE_TIER[item.tier]
    return payload


def server_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL (a bad port) is no HTTPError
        status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
        raise ValueError(f"--base-url {args.base_url}: cannot list its models ({exc}){_hint(args, status)}") from None
    try:
        models = response.json()["data"]
        served = models[0]["id"]
    except (ValueError, LookupError, TypeError):  # not JSON, or not an OpenAI model list
        raise ValueError(f"--base-url {args.base_url}: /v1/models did not answer with an OpenAI model "
                         f"list ({response.text[:80]!r})") from None
    check_model(args, models)
    check_context(args, models)
    return served


def _hint(args: argparse.Namespace, status: int | None) -> str:
    """What a refused model list most likely means, where the status says."""
    if status == 401:
        return ("; the server refused this key (--api-key)" if args.api_key else
                "; the server wants an API key: pass --api-key or set $LENGTHWISE_API_KEY")
    if status == 404 and args.base_url.rstrip("/").endswith("/v1"):
        return "; --base-url is the server's root, without the /v1 an OpenAI client is given"
    return ""


def check_model(args: argparse.Namespace, models: list) -> None:
    """A model the server does not serve is refused (HTTP 404) request by request: the whole load
    would fail, exit 1 and still write its result."""
    names = [m.get("id") for m in models if isinstance(m, dict)]
    if args.model is not None and args.model not in names:
        raise ValueError(f"--model {args.model!r}: the server at {args.base_url} serves "
                         f"{', '.join(map(repr, names))}")


def check_context(args: argparse.Namespace, models: list) -> None:
    """Turns longer than the server's context are refused (HTTP 400) one by one: a load test of
    them all fails, exits 1 and writes its result. The server's max_model_len (vLLM's field too)
    bounds --max-model-len, which picks the turns."""
    entry = next((m for m in models if isinstance(m, dict) and m.get("id") == args.model), models[0])
    served_len = entry.get("max_model_len") if isinstance(entry, dict) else None
    if isinstance(served_len, int) and args.max_model_len > served_len:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the server's max_model_len {served_len}: "
                         f"its longer turns would be refused; pass --max-model-len {served_len}")


def server_state(base_url: str) -> tuple[dict[str, str], float | None]:
    """The server's lengthwise:server_info labels and its cumulative preemptions (empty, None
    when the server exposes no such metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30.0)
    except httpx.HTTPError:
        return {}, None
    info, preemptions = {}, None
    if response.status_code != 200:  # a server without Prometheus metrics, or one failing after the load
        return info, preemptions
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name == "lengthwise:server_info":
                    info = dict(sample.labels)
                elif sample.name == "lengthwise:num_preemptions_total":
                    preemptions = sample.value
    except ValueError:  # not Prometheus text: a run's results must not be lost to it after the load
        return {}, None
    return info, preemptions


def run(args: argparse.Namespace) -> int:
    args.api_key = api_key_or_environment(args.api_key)  # as serve reads it
    slos = report.parse_goodput(args.goodput)
    baseline = bench_serve_compare.load_baseline(args.baseline) if args.baseline else None
    if not args.no_mlflow:  # the run is logged after the load: a store it cannot write fails now
        tracking.check_store(tracking.default_store(), for_writing=True, flag="the MLflow store")
    served = server_model(args)  # a server that cannot be reached fails here, before anything is written
    model = args.model or served
    items = sample_workload(args)
    out = prepare_output_dir(Path(args.result_dir), "--result-dir")  # before the load, not after it
    info, preemptions_before = server_state(args.base_url)
    label = args.label or f"{info.get('policy', 'server')}-rate{args.request_rate:g}"
    if args.baseline is not None and (out / f"{label}.json").resolve() == args.baseline.resolve():
        raise ValueError(f"--baseline {args.baseline}: this run writes its result there ({label}.json in "
                         "--result-dir) and would replace it: pass another --label or --result-dir")
    offsets = arrival_offsets(len(items), args.request_rate, args.burstiness, args.seed)
    results, duration = asyncio.run(run_load(args, items, model, offsets))
    summary = report.summarize(results, duration, slos)
    summary["offered_request_rate_rps"] = offered_rate(offsets)
    if args.ignore_eos:  # every reply must then be exactly max_tokens long: a full response
        summary["short_outputs"] = sum(r.success and r.output_tokens != r.max_tokens for r in results)
    preemptions_after = server_state(args.base_url)[1]
    if preemptions_before is not None and preemptions_after is not None:
        summary["server_preemptions"] = preemptions_after - preemptions_before
    report.print_summary(summary, label)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("api_key", "baseline")}
    config.update(model=model, label=label, baseline=str(args.baseline) if args.baseline else None)
    config.update({f"server_{key}": value for key, value in info.items()})
    if baseline is not None:
        requests = [{"index": r.index, "success": r.success, "output_tokens": r.output_tokens} for r in results]
        summary["comparison"] = bench_serve_compare.compare(summary, config, requests, baseline, args.baseline)
        bench_serve_compare.print_comparison(summary["comparison"])
    json_path, plot_path = out / f"{label}.json", out / f"{label}.png"
    report.write_json(json_path, summary, config, results)
    report.plot(plot_path, results, label)
    print(f"wrote {json_path} and {plot_path}")
    if not args.no_mlflow:
        run_id = report.log_to_mlflow(summary, config, [json_path, plot_path], label)
        print(f"MLflow run {run_id} in {tracking.tracking_uri(tracking.default_store())}")
    return 0 if summary["failed"] == 0 else 1
