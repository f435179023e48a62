"""`training.bench_serve_report.summarize` against numbers worked out by hand and numpy's percentiles.

The timings are binary fractions (multiples of 1/8 s) so that TPOTs and SLO limits compare exactly: a
request sitting exactly on a limit is a real case (`--goodput tpot:250` and a 250 ms TPOT), not float noise.
"""

from __future__ import annotations

import numpy as np
import pytest

from training.bench_serve_report import RequestResult, meets_slos, parse_goodput, summarize

DURATION_S = 4.0
SLOS_MS = ["ttft:500", "tpot:250", "e2el:4000"]


def done(index, prompt, output, ttft, e2e, itl, status=200):
    assert len(itl) == max(output - 1, 0)  # one gap between each pair of streamed tokens
    return RequestResult(index, "standard", prompt, output, start_s=0.125 * index, success=True, status=status,
                         output_tokens=output, ttft_s=ttft, e2e_s=e2e, itl_s=list(itl))


def failed(index, prompt, status, error):
    return RequestResult(index, "standard", prompt, 16, start_s=0.125 * index, success=False, status=status,
                         error=error)


RESULTS = [
    done(0, 8, 15, 0.5, 4.0, [0.25] * 14),  # on every limit: ttft 0.5, tpot 3.5 / 14 = 0.25, e2e 4.0
    done(1, 10, 5, 0.25, 1.0, [0.375, 0.125, 0.125, 0.125]),  # tpot 0.1875
    done(2, 20, 3, 0.125, 0.625, [0.25, 0.25]),  # tpot 0.25
    done(3, 30, 1, 0.375, 0.5, []),  # a one-token reply: no TPOT
    done(4, 40, 6, 1.5, 2.75, [0.25] * 5),  # misses ttft
    done(5, 50, 5, 0.25, 3.25, [0.5, 1.0, 0.75, 0.75]),  # misses tpot (0.75)
    done(6, 60, 17, 0.375, 4.5, [0.25] * 15 + [0.375]),  # misses e2el (and tpot 4.125 / 16)
    done(7, 12, 2, 0.25, 0.5, [0.25], status=None),  # a success recorded without an HTTP status
    failed(8, 5, 429, "HTTP 429: queue full"),
    failed(9, 7, None, "ConnectError: refused"),  # no response at all
    failed(10, 70, 200, "stream ended without [DONE]"),  # answered, then broke: its prompt is not counted
]
COMPLETED = RESULTS[:8]
MEETING = {0, 1, 2, 3, 7}


def test_tpot_is_none_for_a_one_token_reply_and_such_a_reply_meets_a_tpot_slo():
    one_token = RESULTS[3]
    assert one_token.tpot_s is None
    assert meets_slos(one_token, parse_goodput(["tpot:1"]))
    assert RESULTS[2].tpot_s == 0.25 and RESULTS[0].tpot_s == 0.25


def test_a_request_exactly_at_each_limit_meets_it():
    on_limits = RESULTS[0]
    slos = parse_goodput(SLOS_MS)
    assert (on_limits.ttft_s, on_limits.tpot_s, on_limits.e2e_s) == (slos["ttft"], slos["tpot"], slos["e2el"])
    for key in slos:
        assert meets_slos(on_limits, {key: slos[key]}), key
    assert [i for i, r in enumerate(RESULTS) if meets_slos(r, slos)] == sorted(MEETING)


def test_summarize_counts_rates_and_percentiles_exactly():
    summary = summarize(RESULTS, DURATION_S, parse_goodput(SLOS_MS))

    assert (summary["completed"], summary["failed"]) == (8, 3)
    assert summary["rejected_429"] == 1
    assert summary["no_response"] == 1  # request 9 only: request 7 succeeded, status or not
    assert summary["request_throughput_rps"] == 8 / DURATION_S
    output_tokens = 15 + 5 + 3 + 1 + 6 + 5 + 17 + 2
    prompt_tokens = 8 + 10 + 20 + 30 + 40 + 50 + 60 + 12  # completed requests only
    assert summary["total_output_tokens"] == output_tokens == 54
    assert summary["output_tokens_per_s"] == pytest.approx(output_tokens / DURATION_S)
    assert summary["total_tokens_per_s"] == pytest.approx((output_tokens + prompt_tokens) / DURATION_S) == 71.0
    assert summary["goodput_rps"] == pytest.approx(len(MEETING) / DURATION_S)
    assert summary["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 250.0, "e2el": 4000.0}
    assert "per_tier" not in summary
    assert summary["errors"] == sorted(r.error for r in RESULTS if r.error)

    # TPOT: the one-token reply has none and is left out, not counted as zero.
    tpots = [0.25, 0.1875, 0.25, 0.25, 0.75, 4.125 / 16, 0.25]
    # ITL: every gap of every completed request, not one per request.
    gaps = [0.25] * 14 + [0.375, 0.125, 0.125, 0.125] + [0.25, 0.25] + [0.25] * 5 \
        + [0.5, 1.0, 0.75, 0.75] + [0.25] * 15 + [0.375] + [0.25]
    references = {
        "e2e": [4.0, 1.0, 0.625, 0.5, 2.75, 3.25, 4.5, 0.5],
        "ttft": [0.5, 0.25, 0.125, 0.375, 1.5, 0.25, 0.375, 0.25],
        "tpot": tpots,
        "itl": gaps,
    }
    assert summary["mean_tpot_s"] == pytest.approx(sum(tpots) / 7)
    assert len(gaps) == 46 and summary["mean_itl_s"] == pytest.approx(13.375 / 46)
    for name, values in references.items():
        assert summary[f"mean_{name}_s"] == pytest.approx(np.mean(values)), name
        for q in (50, 90, 99):
            assert summary[f"p{q}_{name}_s"] == pytest.approx(np.percentile(values, q)), (name, q)
    # The percentiles are distinct, so a swapped p90/p99 cannot agree by accident.
    assert summary["p90_e2e_s"] < summary["p99_e2e_s"] and summary["p90_tpot_s"] < summary["p99_tpot_s"]


def test_a_failed_request_s_partial_timings_and_tokens_are_left_out():
    # A stream that broke after some tokens, or that the server aborted, has a TTFT, gaps and even
    # a usage count and an e2e (send_one records them as they come): none of it is a completed request's.
    aborted = RequestResult(11, "standard", 90, 16, start_s=1.375, success=False, status=200,
                            error="aborted by the server", output_tokens=9, ttft_s=0.0625, e2e_s=8.0,
                            itl_s=[7.9375 / 8] * 8)
    broken = RequestResult(12, "standard", 80, 16, start_s=1.5, success=False, status=200,
                           error="stream ended without [DONE]", ttft_s=3.0, itl_s=[2.0, 2.0])
    slos = parse_goodput(SLOS_MS)
    with_partial = summarize(RESULTS + [aborted, broken], DURATION_S, slos)
    reference = summarize(RESULTS, DURATION_S, slos)  # checked against numpy above
    assert with_partial["failed"] == reference["failed"] + 2
    for key, value in reference.items():
        if key not in ("failed", "errors"):
            assert with_partial[key] == value, key


def test_an_slo_of_zero_or_less_is_refused():
    # No request meets a 0 ms target: such a goodput would read 0 whatever the server did.
    for item in ("ttft:0", "e2el:-5", "tpot:nan", "itl:100", "ttft"):
        with pytest.raises(ValueError, match="an SLO is KEY:MS"):
            parse_goodput([item])
