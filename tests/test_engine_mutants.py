"""Mutation-review tests of the engine core: each pins a path no other test could see break
(kv cache sizing and swap copies, the runner's batch layout, request lifecycles in the engine
and the async engine's thread)."""

from __future__ import annotations

import io

import pytest
import torch

from engine import kv_cache
from engine.kv_cache import CacheGeometry, KVCache

SMALL = CacheGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32)
CPU = torch.device("cpu")


def fake_meminfo(monkeypatch, text: str) -> None:
    """`available_host_bytes` reads /proc/meminfo through the module's `open`."""
    monkeypatch.setattr(kv_cache, "open", lambda path: io.StringIO(text), raising=False)


def test_available_host_bytes_reads_mem_available_in_kib(monkeypatch):
    fake_meminfo(monkeypatch, "MemTotal:       8000 kB\nMemFree:        1000 kB\nMemAvailable:   3000 kB\n")
    assert kv_cache.available_host_bytes() == 3000 * 1024
    fake_meminfo(monkeypatch, "MemTotal:       8000 kB\n")  # an old kernel without the field
    assert kv_cache.available_host_bytes() is None


def limit_host_bytes(monkeypatch, num_bytes: int | None) -> None:
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: num_bytes)


def test_a_cpu_cache_counts_both_pools_against_host_memory(monkeypatch):
    block = SMALL.bytes_per_block
    limit_host_bytes(monkeypatch, 10 * block)
    KVCache(SMALL, num_gpu_blocks=6, num_cpu_blocks=4, device=CPU)  # exactly the memory free: fits
    # On a CPU the device pool is host memory too: 4 host blocks alone would fit, 7 + 4 do not.
    with pytest.raises(ValueError, match="host memory"):
        KVCache(SMALL, num_gpu_blocks=7, num_cpu_blocks=4, device=CPU)
    with pytest.raises(ValueError, match=r"host memory \(kv_cache_memory_gib on a CPU plus swap_space_gib for swap"):
        KVCache(SMALL, num_gpu_blocks=6, num_cpu_blocks=5, device=CPU)
    # Without a swap pool the message names no swap setting (recompute preemption allocates none).
    with pytest.raises(ValueError, match=r"host memory \(kv_cache_memory_gib on a CPU\), more"):
        KVCache(SMALL, num_gpu_blocks=11, num_cpu_blocks=0, device=CPU)
    limit_host_bytes(monkeypatch, None)  # unknown: not refused
    KVCache(SMALL, num_gpu_blocks=7, num_cpu_blocks=5, device=CPU)


def test_dtype_auto_is_float32_on_a_cpu_and_bfloat16_or_float16_on_a_gpu(monkeypatch, tiny_model_dir):
    # vLLM's --dtype auto was refused ("must be one of").
    import argparse

    from engine.config import EngineConfig
    from engine.llm_engine import config_dtype, resolve_dtype
    from engine.server import serve_cli

    llm = LLM(str(tiny_model_dir), max_model_len=128, num_gpu_blocks=8, num_threads=1, dtype="auto", device="cpu")
    assert llm.engine.config.dtype == "float32" and llm.engine.kv_cache.device_cache.dtype == torch.float32
    for has_bf16, expected in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: has_bf16)
        assert resolve_dtype("auto", torch.device("cuda")) == expected
    assert resolve_dtype("float16", CPU) == "float16"  # a named dtype is kept
    # What sizes the cache outside an engine (bench engine, the probe script) resolves it alike.
    assert config_dtype(EngineConfig(model=str(tiny_model_dir), dtype="auto", device="cpu")) == torch.float32
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.build_engine_config(parser.parse_args(["--dtype", "auto"])).dtype == "auto"


def test_a_cache_pinned_by_num_gpu_blocks_is_named_by_it_when_too_large(monkeypatch, tiny_model_dir):
    # It named kv_cache_memory_gib, which the pinned block count overrides: changing it did nothing.
    limit_host_bytes(monkeypatch, 1024)
    with pytest.raises(ValueError, match=r"host memory \(num_gpu_blocks on a CPU\), more"):
        LLM(str(tiny_model_dir), max_model_len=128, num_gpu_blocks=64, num_threads=1)
    with pytest.raises(ValueError, match=r"host memory \(kv_cache_memory_gib on a CPU\), more"):
        LLM(str(tiny_model_dir), max_model_len=128, num_threads=1)


def test_swap_copies_exactly_the_paired_blocks_and_nothing_else():
    cache = KVCache(SMALL, num_gpu_blocks=6, num_cpu_blocks=4, device=CPU)
    cache.device_cache.copy_(torch.randn_like(cache.device_cache))
    cache.host_cache.copy_(torch.randn_like(cache.host_cache))
    device_before, host_before = cache.device_cache.clone(), cache.host_cache.clone()
    cache.swap_out(((5, 1), (2, 3), (0, 0)))
    for device_block, host_block in ((5, 1), (2, 3), (0, 0)):
        torch.testing.assert_close(cache.host_cache[:, :, host_block], device_before[:, :, device_block])
    torch.testing.assert_close(cache.host_cache[:, :, 2], host_before[:, :, 2])  # unpaired: untouched
    torch.testing.assert_close(cache.device_cache, device_before)  # a swap-out only reads the device
    host_after_out = cache.host_cache.clone()
    cache.swap_in(((3, 4), (1, 1)))
    torch.testing.assert_close(cache.device_cache[:, :, 4], device_before[:, :, 2])
    torch.testing.assert_close(cache.device_cache[:, :, 1], device_before[:, :, 5])
    for untouched in (0, 2, 3, 5):
        torch.testing.assert_close(cache.device_cache[:, :, untouched], device_before[:, :, untouched])
    torch.testing.assert_close(cache.host_cache, host_after_out)
    cache.swap_out(())  # an empty step copies nothing and does not fail
    cache.swap_in(())
    torch.testing.assert_close(cache.host_cache, host_after_out)


def test_each_layer_view_is_its_own_slice_of_the_cache():
    cache = KVCache(SMALL, num_gpu_blocks=6, num_cpu_blocks=4, device=CPU)
    for layer, (key, value) in enumerate(cache.layers):
        assert key.data_ptr() == cache.device_cache[layer, 0].data_ptr()
        assert value.data_ptr() == cache.device_cache[layer, 1].data_ptr()


# ---- the offline engine --------------------------------------------------------------------

from engine import model_runner  # noqa: E402
from engine.llm import LLM  # noqa: E402
from predictor.base import Prediction  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

GREEDY6 = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=64, num_gpu_blocks=64,
               num_threads=1)


def test_aborting_an_id_the_engine_does_not_hold_says_so_and_changes_nothing(llm):
    engine = llm.engine
    llm.generate("Hello there", GREEDY6)  # finished: no longer held
    assert engine.abort_request("offline-0") is False
    assert engine.abort_request("never-added") is False
    engine.add_request("held", "Hello there", GREEDY6)
    assert engine.abort_request("held") is True
    assert engine.abort_request("held") is False  # a second abort finds nothing
    stats = engine.stats().scheduler
    assert not engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def test_a_callers_arrival_time_is_the_requests(llm):
    engine = llm.engine
    arrival = engine.now() - 5.0
    engine.add_request("early", "Hello there", GREEDY6, arrival_time=arrival)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].arrival_time == arrival


class FixedPredictor:
    """Predicts the same lengths for every prompt, and records what it scored."""

    def __init__(self, prediction: Prediction) -> None:
        self.prediction, self.scored = prediction, []

    def predict(self, prompts):
        self.scored.append(list(prompts))
        return [self.prediction] * len(prompts)


def test_add_request_scores_an_unpredicted_prompt_and_hands_the_scheduler_every_length(llm, monkeypatch):
    engine = llm.engine
    predictor = FixedPredictor(Prediction(point=11.0, p50=12.0, p90=30.0, score=-1.0, rank_len=13.0))
    monkeypatch.setattr(engine, "predictor", predictor)
    engine.add_request("scored", "Hello there", GREEDY6)
    request = engine.scheduler.get_request("scored")
    assert predictor.scored == [["Hello there"]]
    assert (request.predicted_len, request.predicted_p50, request.predicted_p90, request.predicted_rank_len) == (
        11.0, 12.0, 30.0, 13.0)
    # A prediction the caller brings is used as it is, not scored again.
    given = Prediction(point=1.0, p50=2.0, p90=3.0, score=0.0, rank_len=4.0)
    engine.add_request("given", "Hello there", GREEDY6, prediction=given)
    assert len(predictor.scored) == 1 and engine.scheduler.get_request("given").predicted_p90 == 3.0
    assert engine.predict([]) == []
    for request_id in ("scored", "given"):
        engine.abort_request(request_id)


def test_prompt_logprobs_scored_in_small_pieces_equal_one_piece(tiny_model_dir, monkeypatch):
    # Every test prompt is shorter than PROMPT_LOGPROBS_ROWS; with pieces of 4 rows, a chunked
    # prefill scores each chunk in several pieces, and each must read its own rows.
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16, num_threads=1)
    prompts = [list(range(100, 137)), list(range(300, 322))]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    whole = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 4)
    pieces = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    assert [len(p) for p in pieces] == [len(p) for p in whole] == [37, 22]
    for piece_entries, whole_entries in zip(pieces, whole):
        assert piece_entries[0] is whole_entries[0] is None
        for got, want in zip(piece_entries[1:], whole_entries[1:]):
            assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)


def test_logprobs_are_the_models_not_the_biased_ones(llm):
    # Biasing the token greedy picks anyway leaves the tokens as they were; their logprobs are the
    # model's own distribution, as the field says, not the processed logits'.
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))[0]
    (token,) = plain.token_ids
    biased = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1,
                                                   logit_bias={token: 50.0}))[0]
    assert biased.token_ids == plain.token_ids
    assert biased.logprobs[0].logprob == pytest.approx(plain.logprobs[0].logprob, abs=1e-5)
    assert plain.logprobs[0].logprob < -0.5  # a flat tiny model: far from the biased ~0
    # The tokens, though, are drawn from the processed logits: a bias decides greedy's pick.
    other = (token + 1) % 49152
    steered = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logit_bias={other: 100.0}))[0]
    assert steered.token_ids == (other,)


def scored_prompt_logprobs(runner, request, start: int, length: int, held: int):
    """The prompt logprobs the runner finds for one prefill chunk, given `held` positions held."""
    from scheduler.output import ScheduledChunk, SchedulerOutput

    chunk = ScheduledChunk(request.request_id, tuple(request.prompt_token_ids[start:start + length]),
                           start_position=start, block_ids=(0, 1), sample=False)
    output = SchedulerOutput((chunk,), (), (), (), (), length)
    return runner.execute(output, lambda _: request, lambda _: held).prompt_logprobs[request.request_id]


def test_a_reprefill_scores_only_the_prompt_positions_not_held_from_its_own_rows(tiny_model_dir):
    # A request preempted mid-prefill is re-prefilled from position 0 holding the logprobs of its
    # first positions: the runner must score the rest, each from the row that predicts it.
    from scheduler.request import Request

    runner = LLM(str(tiny_model_dir), max_model_len=64, num_gpu_blocks=4, num_threads=1).engine.runner
    request = Request("r", list(range(200, 220)), SamplingParams(prompt_logprobs=1), arrival_time=0.0,
                      eos_token_id=2)
    full = scored_prompt_logprobs(runner, request, 0, 20, held=0)
    assert full.first_position == 1 and len(full.entries) == 19
    again = scored_prompt_logprobs(runner, request, 0, 20, held=9)  # positions 0..8 held
    assert again.first_position == 9 and len(again.entries) == 11
    for got, want in zip(again.entries, full.entries[8:]):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)
    second_chunk = scored_prompt_logprobs(runner, request, 12, 8, held=13)  # after a first chunk of 12
    assert second_chunk.first_position == 13 and len(second_chunk.entries) == 7
    for got, want in zip(second_chunk.entries, full.entries[12:]):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)


@pytest.mark.parametrize("fields, message", [
    ({"max_model_len": 2049}, "exceeds the model's 2048 positions"),  # one past the tiny model's positions
    ({"kv_cache_memory_gib": 1e-9}, "holds no KV block"),  # a budget under one block
])
def test_an_engine_that_could_not_serve_is_refused_at_construction(tiny_model_dir, fields, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir), num_threads=1, **fields)


def test_the_longest_context_the_model_has_is_accepted(tiny_model_dir):
    full = LLM(str(tiny_model_dir), max_model_len=2048, num_gpu_blocks=8, num_threads=1)
    assert full.engine.config.max_model_len == 2048


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {49152: 1.0}), ("allowed_token_ids", [49152]), ("bad_words_token_ids", [[49152]]),
])
def test_a_sampler_token_id_one_past_the_vocabulary_is_refused(llm, field, value):
    with pytest.raises(ValueError, match=f"{field} names token ids outside the vocabulary"):
        llm.generate("Hello there", SamplingParams(max_tokens=2, **{field: value}))
    llm.generate("Hello there", SamplingParams(max_tokens=2, **{field: {49151: 1.0} if field == "logit_bias"
                                                                  else [49151] if field == "allowed_token_ids"
                                                                  else [[49151]]}))
    assert not llm.engine.has_unfinished_requests()


def test_allowed_ids_are_refused_only_when_min_tokens_or_bad_words_rule_every_one_out(llm):
    eos = llm.engine.eos_token_id
    with pytest.raises(ValueError, match="only stop tokens"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=(eos, 9), stop_token_ids=[9],
                                               min_tokens=2))
    # Under ignore_eos too: min_tokens rules the end token out then as well.
    with pytest.raises(ValueError, match="only stop tokens"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=(eos,), min_tokens=2, ignore_eos=True))
    # Ruled out as a one-token bad word, or some as bad words and the rest as stops under
    # min_tokens: every logit was -inf, and greedy took token 0, which the set excludes.
    with pytest.raises(ValueError, match="every allowed token is a one-token bad word"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=(100,), bad_words_token_ids=[[100]],
                                               temperature=0.0))
    with pytest.raises(ValueError, match="or a stop token, which min_tokens rules out"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=(eos, 100), min_tokens=2,
                                               bad_words_token_ids=[[100]]))
    # A longer bad word rules its last token out only after the rest: it may still be drawn.
    (output,) = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=(100,),
                                                       bad_words_token_ids=[[7, 100]], ignore_eos=True))
    assert output.token_ids == (100, 100, 100)
    # Some allowed id is no stop: min_tokens can be met.
    for params in (SamplingParams(max_tokens=3, allowed_token_ids=(eos, 9), min_tokens=2),
                   SamplingParams(max_tokens=3, allowed_token_ids=(eos, 9), min_tokens=2, ignore_eos=True)):
        (output,) = llm.generate([5, 6, 7], params)
        assert output.finished and len(output.token_ids) >= 2  # min_tokens held
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_that_is_not_unicode_text_is_a_value_error_and_nothing_is_queued(llm, monkeypatch):
    # A lone surrogate (bytes that were not UTF-8): the tokenizer raised TypeError, against the
    # API's ValueError for bad input, and the predictor's batch failed on it first (the default
    # predictor's tokenizer raises the same TypeError).
    scored = []

    class Predictor:
        def predict(self, prompts):
            scored.extend(prompts)
            raise TypeError("TextEncodeInput must be Union[...]")

    monkeypatch.setattr(llm.engine, "predictor", Predictor())
    with pytest.raises(ValueError, match="not valid Unicode text"):
        llm.generate(["ok", "bad \udcff"], SamplingParams(max_tokens=2))
    assert scored == [] and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("count", [0, 2, 3])
def test_generate_wants_one_sampling_params_per_prompt_or_one_for_all(llm, count):
    with pytest.raises(ValueError, match=f"got {count} sampling params for 1 prompts"):
        llm.generate(["Hello there"], [GREEDY6] * count)
    assert not llm.engine.has_unfinished_requests()


def test_add_request_takes_sampling_params_only(llm):
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        llm.engine.add_request("x", [5, 6, 7], {"max_tokens": 2})
    assert not llm.engine.has_unfinished_requests()


# ---- the async engine's thread -------------------------------------------------------------

import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import time  # noqa: E402
import threading  # noqa: E402

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.engine_commands import Call  # noqa: E402
from engine.async_stream import EngineShuttingDown, EngineState  # noqa: E402
from test_server import tiny_engine  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    return tiny_engine(tiny_model_dir)


async def collect(stream) -> list:
    return [item async for item in stream]


def test_a_finished_request_leaves_the_engine_thread_nothing_and_its_stats_are_current(served):
    async def scenario():
        async_engine = AsyncLLMEngine(served)
        await async_engine.start()
        ids = served.tokenizer.encode("Hello there", add_special_tokens=False)
        generated_before = async_engine.stats.num_generated_tokens
        outputs = await asyncio.wait_for(collect(await async_engine.submit("done", ids, "Hello there", GREEDY6)), 60)
        # The stats are renewed after the step, before its outputs are handed to the loop.
        generated = async_engine.stats.num_generated_tokens - generated_before
        live = set(async_engine._worker._live)
        await async_engine.shutdown()
        return outputs, generated, live

    outputs, generated, live = asyncio.run(scenario())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 6
    assert generated == 6
    assert live == set()  # a finished request is no longer the engine thread's to abort


def test_a_call_cancelled_before_the_engine_thread_reaches_it_is_skipped(served):
    async def scenario():
        async_engine = AsyncLLMEngine(served)
        await async_engine.start()
        gate, ran = threading.Event(), []
        held = async_engine.call_in_engine(lambda _: gate.wait(30))  # the engine thread waits here
        cancelled = async_engine.call_in_engine(lambda _: ran.append(1))
        assert cancelled.cancel()
        gate.set()
        assert await asyncio.wrap_future(held)
        after = await asyncio.wrap_future(async_engine.call_in_engine(lambda e: e.has_unfinished_requests()))
        state = async_engine.state
        await async_engine.shutdown()
        return ran, after, state

    ran, after, state = asyncio.run(scenario())
    assert ran == [] and after is False and state is EngineState.RUNNING


def test_generate_returns_results_in_prompt_order_not_finish_order(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 2, 5)]
    outputs = llm.generate([[5, 6], [7, 8], [9, 10]], params)
    assert [list(o.prompt_token_ids) for o in outputs] == [[5, 6], [7, 8], [9, 10]]
    assert [len(o.token_ids) for o in outputs] == [9, 2, 5]


def test_an_interrupt_inside_add_request_after_the_scheduler_took_it_still_aborts_it(llm, monkeypatch):
    engine = llm.engine
    track, calls = engine.output_processor.add, []

    def interrupted_on_the_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the scheduler holds the request already
        return track(*args)

    monkeypatch.setattr(engine.output_processor, "add", interrupted_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello there", "Count to ten"], GREEDY6)
    monkeypatch.setattr(engine.output_processor, "add", track)
    stats = engine.stats().scheduler
    assert not engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def test_config_and_config_fields_together_are_refused(tiny_model_dir):
    from engine.config import EngineConfig

    config = EngineConfig(model=str(tiny_model_dir), num_threads=1)
    for fields in ({"model": str(tiny_model_dir)}, {"num_threads": 1}):
        with pytest.raises(ValueError, match="not both"):
            LLM(config=config, **fields)


def test_an_empty_step_still_applies_its_swap_copies(tiny_model_dir):
    from scheduler.output import SchedulerOutput

    runner = LLM(str(tiny_model_dir), max_model_len=64, num_gpu_blocks=4, preemption_mode="swap",
                 num_threads=1).engine.runner
    cache = runner.kv_cache
    cache.device_cache[:, :, 2].normal_()
    out = runner.execute(SchedulerOutput((), (), (), ((2, 0),), (), 0), lambda _: None)
    assert out.sampled_token_ids == {}
    torch.testing.assert_close(cache.host_cache[:, :, 0], cache.device_cache[:, :, 2])
    runner.execute(SchedulerOutput((), (), (), (), ((0, 3),), 0), lambda _: None)
    torch.testing.assert_close(cache.device_cache[:, :, 3], cache.device_cache[:, :, 2])
    # Both in one step: no order of the copies is safe (a freed block may be the other's).
    with pytest.raises(ValueError, match="not both"):
        runner.execute(SchedulerOutput((), (), (), ((1, 1),), ((0, 2),), 0), lambda _: None)


def test_a_call_after_the_engine_thread_failed_is_answered_with_the_failure(tiny_model_dir, monkeypatch):
    # submit checks the state first; call_in_engine does not, so the dead thread's refusal loop
    # must still be there to answer it.
    from engine.async_stream import EngineDead

    broken = tiny_engine(tiny_model_dir)

    def failing_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(broken, "step", failing_step)

    async def scenario():
        async_engine = AsyncLLMEngine(broken)
        await async_engine.start()
        ids = broken.tokenizer.encode("Hello there", add_special_tokens=False)
        stream = await async_engine.submit("doomed", ids, "Hello there", GREEDY6)
        items = await asyncio.wait_for(collect(stream), 30)  # ends once the failure reached the loop
        no_streams = async_engine._no_streams.is_set()  # a drain now has nothing to wait for
        late = async_engine.call_in_engine(lambda e: "ran")
        with pytest.raises(EngineDead, match="device lost"):
            await asyncio.wait_for(asyncio.wrap_future(late), 30)
        async_engine.begin_drain()  # a stop signal after the failure: the engine stays failed
        await async_engine.shutdown(grace_s=0)
        return items, no_streams, async_engine.state

    items, no_streams, state = asyncio.run(scenario())
    assert len(items) == 1 and items[0].reason == "error" and "device lost" in items[0].message
    assert no_streams and state is EngineState.FAILED


def test_a_step_that_never_returns_reads_unhealthy_and_does_not_hold_shutdown(tiny_model_dir, monkeypatch):
    # A stuck step raises nothing: /health said 200 while nothing progressed, and shutdown joined
    # the engine thread forever.
    from types import SimpleNamespace

    from engine.server.app import health

    engine = tiny_engine(tiny_model_dir)
    passing, entered = threading.Event(), threading.Event()
    real_step = engine.step

    def gated_step():
        if not passing.is_set():
            entered.set()
            passing.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step", gated_step)

    async def scenario():
        async_engine = AsyncLLMEngine(engine, stall_s=0.2)
        await async_engine.start()
        idle = async_engine.healthy
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        stream = await async_engine.submit("stuck", ids, "Hello there", GREEDY6)
        await asyncio.to_thread(entered.wait, 30)
        await asyncio.sleep(0.3)
        stuck = (async_engine.healthy, async_engine.stalled_s)
        state = SimpleNamespace(served=SimpleNamespace(engine=async_engine))
        answer = await health(SimpleNamespace(app=SimpleNamespace(state=state)))
        passing.set()  # it moves again: healthy once more
        first = await asyncio.wait_for(collect(stream), 30)
        recovered = async_engine.healthy
        passing.clear()
        entered.clear()
        stream = await async_engine.submit("stuck again", ids, "Hello there", GREEDY6)
        await asyncio.to_thread(entered.wait, 30)
        await asyncio.sleep(0.3)
        started = asyncio.get_running_loop().time()
        await async_engine.shutdown(grace_s=0)  # the step still stuck: left behind
        shutdown_s = asyncio.get_running_loop().time() - started
        passing.set()
        second = await asyncio.wait_for(collect(stream), 30)
        return idle, stuck, answer, first, recovered, shutdown_s, second

    idle, (healthy, stalled_s), answer, first, recovered, shutdown_s, second = asyncio.run(scenario())
    assert idle and not healthy and stalled_s >= 0.2
    assert answer.status_code == 500 and b"stalled" in answer.body
    assert first[-1].finished and recovered
    assert shutdown_s < 25  # not the 30 s the step stays stuck for
    assert second[-1].reason == "abort"


class GatedPredictor:
    """Predicts only once `gate` opens, having set `inside`: a predictor stuck in a call."""

    def __init__(self, inside: threading.Event, gate: threading.Event) -> None:
        self.inside, self.gate = inside, gate

    def predict(self, prompts):
        self.inside.set()
        self.gate.wait(30)
        return [Prediction(point=5.0, p50=5.0, p90=9.0, score=0.0, rank_len=5.0)] * len(prompts)


def test_a_command_or_an_overlapped_prediction_that_never_returns_reads_stalled(tiny_model_dir):
    # Only a step counted as busy: an add, abort or call stuck between steps, or a predictor
    # thread stuck in a batch (holding every arrival back), left /health at 200.
    engine = tiny_engine(tiny_model_dir)
    inside, gate = threading.Event(), threading.Event()

    async def stuck_then_freed(async_engine, make_stuck):
        inside.clear()
        gate.clear()
        waiting = asyncio.ensure_future(make_stuck())
        assert await asyncio.to_thread(inside.wait, 30)
        await asyncio.sleep(0.3)
        stuck = async_engine.stalled_s
        gate.set()
        done = await asyncio.wait_for(waiting, 30)
        return stuck, done, async_engine.healthy

    async def scenario():
        calls = AsyncLLMEngine(engine, stall_s=0.2)
        await calls.start()
        call = await stuck_then_freed(
            calls, lambda: asyncio.wrap_future(calls.call_in_engine(lambda _: inside.set() or gate.wait(30))))
        await calls.shutdown(grace_s=0)
        overlapped = AsyncLLMEngine(engine, GatedPredictor(inside, gate), overlap_prediction=True, stall_s=0.2)
        await overlapped.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)

        async def served():
            return await collect(await overlapped.submit("held", ids, "Hello there", GREEDY6))

        prediction = await stuck_then_freed(overlapped, served)
        await overlapped.shutdown(grace_s=0)
        return call, prediction

    (call_stuck, called, call_healthy), (predict_stuck, outputs, predict_healthy) = asyncio.run(scenario())
    assert call_stuck >= 0.2 and called is True and call_healthy
    assert predict_stuck >= 0.2 and outputs[-1].finished and predict_healthy


def test_shutdown_leaves_behind_only_the_thread_that_stalled(tiny_model_dir):
    # A stuck predictor thread made the whole engine read stalled, and shutdown then gave up on
    # the engine thread too, left running mid-call.
    engine = tiny_engine(tiny_model_dir)
    inside, gate = threading.Event(), threading.Event()

    async def scenario():
        async_engine = AsyncLLMEngine(engine, GatedPredictor(inside, gate), overlap_prediction=True, stall_s=0.3)
        await async_engine.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        held = asyncio.ensure_future(async_engine.submit("held", ids, "Hello there", GREEDY6))
        assert await asyncio.to_thread(inside.wait, 30)
        await asyncio.sleep(0.4)  # the predictor thread has stalled
        async_engine.call_in_engine(lambda _: time.sleep(0.25))  # busy, not stalled
        await asyncio.sleep(0.05)
        await async_engine.shutdown(grace_s=0)
        engine_thread_alive = async_engine._threads[0].is_alive()
        gate.set()  # the predictor thread left behind hands its batch to an ended engine thread
        try:
            await asyncio.wait_for(held, 10)  # answered, not left waiting for good
        except EngineShuttingDown:
            return engine_thread_alive, "refused"
        return engine_thread_alive, "admitted"

    assert asyncio.run(scenario()) == (False, "refused")


def test_an_abort_ends_the_stream_its_reader_holds_and_spares_a_new_request_under_its_id(tiny_model_dir):
    # The aborted stream was forgotten, not ended: a reader of it waited for good. And the drop
    # ran a tick later, on whatever stream held the id by then: a request resubmitted under the
    # id in the same tick lost its stream, and its reader waited for good too.
    engine = tiny_engine(tiny_model_dir)
    long = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)  # to the end of the context

    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        stream = await async_engine.submit("x", ids, "Hello there", long)
        reader = asyncio.ensure_future(collect(stream))
        await asyncio.sleep(0.05)
        async_engine.abort("x")
        aborted = await asyncio.wait_for(reader, 30)
        again = await async_engine.submit("y", ids, "Hello there", long)
        async_engine.abort("y")
        reused = await async_engine.submit("y", ids, "Hello there", GREEDY6)  # the same tick
        outputs = await asyncio.wait_for(collect(reused), 30)
        first = await asyncio.wait_for(collect(again), 30)
        await async_engine.shutdown(grace_s=0)
        return aborted, first, outputs

    aborted, first, outputs = asyncio.run(scenario())
    assert aborted[-1].reason == "abort" and first[-1].reason == "abort"
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 6


def test_an_abort_from_another_thread_ends_the_stream_and_counts_a_request_once(tiny_model_dir):
    # From another thread the drop was posted: it ended nothing, and counted as aborted a request
    # that had finished by the time it ran.
    from engine.async_stream import NullListener

    class Counting(NullListener):
        def __init__(self):
            self.aborted: list[str] = []

        def on_aborted(self, request_id, tier, reason="abort"):
            self.aborted.append(request_id)

    engine = tiny_engine(tiny_model_dir)
    listener = Counting()
    long = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)

    async def scenario():
        async_engine = AsyncLLMEngine(engine, listener=listener)
        await async_engine.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        running = await async_engine.submit("running", ids, "Hello there", long)
        reader = asyncio.ensure_future(collect(running))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(async_engine.abort, "running")
        aborted = await asyncio.wait_for(reader, 30)
        done = await async_engine.submit("done", ids, "Hello there", GREEDY6)

        async def delivered():  # finished (forgotten on delivery), its end not yet read
            while "done" in async_engine._streams:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(delivered(), 30)
        # The race: an abort from another thread saw it running, and its posted drop runs now.
        async_engine._drop_aborted("done", done)
        finished = await asyncio.wait_for(collect(done), 30)
        await async_engine.shutdown(grace_s=0)
        return aborted, finished

    aborted, finished = asyncio.run(scenario())
    assert aborted[-1].reason == "abort" and finished[-1].finished
    assert listener.aborted == ["running"]


def test_a_call_after_the_engine_thread_ended_is_refused_not_left_waiting(tiny_model_dir):
    # Queued after the thread's last refusal, nobody answered it.
    from engine.async_stream import EngineShuttingDown

    async def scenario():
        async_engine = AsyncLLMEngine(tiny_engine(tiny_model_dir))
        await async_engine.start()
        await async_engine.shutdown(grace_s=0)
        late = async_engine.call_in_engine(lambda engine: "ran")
        with pytest.raises(EngineShuttingDown):
            await asyncio.wait_for(asyncio.wrap_future(late), 30)

    asyncio.run(scenario())


def test_a_failing_listener_loses_no_output(tiny_model_dir):
    # The metrics listener ran before each output reached its stream: one that raised dropped the
    # rest of the step's outputs, a finished one among them, and its client waited for good.
    from engine.async_stream import NullListener

    class Failing(NullListener):
        def on_output(self, *args, **kwargs):
            raise RuntimeError("a metrics bug")

        on_finished = on_admitted = on_output

    engine = tiny_engine(tiny_model_dir)

    async def scenario():
        async_engine = AsyncLLMEngine(engine, listener=Failing())
        await async_engine.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        streams = [await async_engine.submit(f"r{i}", ids, "Hello there", GREEDY6) for i in range(2)]
        items = [await asyncio.wait_for(collect(stream), 30) for stream in streams]
        await async_engine.shutdown(grace_s=0)
        return items

    for items in asyncio.run(scenario()):
        assert items[-1].finished and len(items[-1].token_ids) == 6


@pytest.mark.parametrize("where", ["call", "add_request"])
def test_a_system_exit_inside_a_command_answers_its_caller_and_fails_the_engine(tiny_model_dir, monkeypatch, where):
    # Only Exceptions were answered: a SystemExit left the command's future running, unanswered by
    # the refusal loop, and its caller waited forever.
    from engine.async_stream import EngineDead

    engine = tiny_engine(tiny_model_dir)

    def leave(*args, **kwargs):
        raise SystemExit("bye")

    if where == "add_request":
        monkeypatch.setattr(engine, "add_request", leave)

    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        with pytest.raises(EngineDead, match="SystemExit: bye"):
            if where == "call":
                await asyncio.wait_for(asyncio.wrap_future(async_engine.call_in_engine(leave)), 30)
            else:
                await asyncio.wait_for(async_engine.submit("left", ids, "Hello there", GREEDY6), 30)
        late = async_engine.call_in_engine(lambda e: "ran")  # refused by the failed thread, not left waiting
        with pytest.raises(EngineDead, match="SystemExit: bye"):
            await asyncio.wait_for(asyncio.wrap_future(late), 30)
        await async_engine.shutdown(grace_s=0)
        return async_engine.state

    assert asyncio.run(scenario()) is EngineState.FAILED


def test_a_call_behind_the_stop_in_one_batch_is_refused_by_the_ending_thread(served):
    from engine.async_stream import EngineShuttingDown
    from engine.engine_commands import Stop

    async def scenario():
        async_engine = AsyncLLMEngine(served)
        await async_engine.start()
        gate = threading.Event()
        held = async_engine.call_in_engine(lambda _: gate.wait(30))  # the engine thread waits here
        async_engine._commands.put(Stop())
        late = async_engine.call_in_engine(lambda e: "ran")  # drained with the Stop, after it
        gate.set()
        await asyncio.wrap_future(held)
        with pytest.raises(EngineShuttingDown):
            await asyncio.wait_for(asyncio.wrap_future(late), 30)
        await asyncio.to_thread(async_engine._threads[0].join, 30)
        return async_engine._threads[0].is_alive()

    assert asyncio.run(scenario()) is False


class RecordingPredictor:
    def __init__(self) -> None:
        self.scored: list[str] = []

    PREDICTION = Prediction(point=5.0, p50=5.0, p90=9.0, score=0.0, rank_len=5.0)

    def predict(self, prompts):
        self.scored += prompts
        return [self.PREDICTION for _ in prompts]


def test_a_submission_cancelled_before_the_engine_thread_drains_it_is_not_scored(served):
    async def scenario():
        predictor = RecordingPredictor()
        async_engine = AsyncLLMEngine(served, predictor)
        await async_engine.start()
        inside, gate = threading.Event(), threading.Event()
        held = async_engine.call_in_engine(lambda _: inside.set() or gate.wait(30))
        assert await asyncio.to_thread(inside.wait, 30)  # the engine thread waits, its batch drained
        ids = served.tokenizer.encode("Hello there", add_special_tokens=False)
        left = asyncio.ensure_future(async_engine.submit("left", ids, "the client left", GREEDY6))
        stays = asyncio.ensure_future(async_engine.submit("stays", ids, "the client stays", GREEDY6))
        while async_engine.num_pending < 2:  # what /metrics exports as num_requests_pending
            await asyncio.sleep(0)
        left.cancel()
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wrap_future(held)
        stream = await stays
        outputs = await asyncio.wait_for(collect(stream), 60)
        pending_after = async_engine.num_pending
        await async_engine.shutdown()
        return predictor.scored, outputs, stream.prediction, pending_after

    scored, outputs, prediction, pending_after = asyncio.run(scenario())
    assert scored == ["the client stays"] and outputs[-1].finished and pending_after == 0
    assert prediction == RecordingPredictor.PREDICTION  # the stream carries it to the metrics


def test_the_stats_are_renewed_after_each_batch_of_commands(served):
    # Driven by hand, without the thread: what a batch of commands changed shows in the stats
    # at once, not only after the next step.
    import concurrent.futures

    from engine.engine_commands import Call

    async_engine = AsyncLLMEngine(served)
    worker = async_engine._worker
    waiting_before = worker.stats.scheduler.num_waiting
    added: concurrent.futures.Future = concurrent.futures.Future()
    async_engine._commands.put(Call(lambda e: e.add_request("queued", [5, 6, 7], GREEDY6), added))
    assert worker.run_commands(block=False) is True
    assert worker.stats.scheduler.num_waiting == waiting_before + 1
    served.abort_request("queued")
    assert not served.has_unfinished_requests()


def test_a_round_of_commands_while_requests_run_is_charged_to_the_next_steps_time(tiny_model_dir):
    # Only the step itself was timed: admission's token rates described an engine thread that
    # never paused for admissions, aborts or inline prediction, and every delay read low.
    engine = tiny_engine(tiny_model_dir)
    async_engine = AsyncLLMEngine(engine)
    worker = async_engine._worker
    engine.add_request("running", [5, 6, 7], GREEDY6)
    for block in (True, False):  # idle (it waited for the command), then with requests running
        async_engine._commands.put(Call(lambda e: time.sleep(0.2), concurrent.futures.Future()))
        assert worker.run_commands(block=block) is True
    charged = engine._time_between_steps_s
    engine.step()
    assert 0.2 <= charged < 0.4  # the one round while a request ran
    assert engine.scheduler.admission.mean_step_time_s >= 0.2 and engine._time_between_steps_s == 0.0
    engine.abort_request("running")


# ---- streams and commands, by hand ---------------------------------------------------------

def submission(request_id: str = "s"):
    from engine.engine_commands import Submission
    from scheduler.request import Tier

    return Submission(request_id, [5, 6], "text", GREEDY6, Tier.STANDARD, 0, 0.0)


def test_was_admitted_only_once_the_engine_took_it():
    pending, taken, refused, cancelled = (submission(name) for name in ("p", "t", "r", "c"))
    taken.admitted.set_result(None)
    refused.admitted.set_exception(ValueError("bad prompt"))
    cancelled.admitted.cancel()
    assert [s.was_admitted() for s in (pending, taken, refused, cancelled)] == [False, True, False, False]


def test_refusing_answers_every_command_up_to_the_stop_and_leaves_the_rest():
    import concurrent.futures
    import queue

    from engine.engine_commands import Abort, Call, Stop, refuse_until_stopped

    commands: queue.SimpleQueue = queue.SimpleQueue()
    first, gone, call, after = submission("a"), submission("b"), Call(lambda e: e, concurrent.futures.Future()), \
        Call(lambda e: e, concurrent.futures.Future())
    gone.admitted.cancel()  # the client left: nothing to answer
    for command in (first, gone, Abort("a"), call, Stop(), after):
        commands.put(command)
    error = RuntimeError("engine gone")
    refuse_until_stopped(commands, error)
    assert first.admitted.exception() is error and call.result.exception() is error
    assert gone.admitted.cancelled() and not after.result.done()
    assert commands.get_nowait() is after  # behind the Stop: left for whoever reads on
    refuse_until_stopped(commands, error, block=False)  # an empty queue: returns at once


def test_an_end_that_replaces_an_unread_output_keeps_its_text_logprobs_and_token_count():
    from engine.async_stream import RequestStream, StreamEnd
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs
    from scheduler.request import Tier

    logprobs = (TokenLogprobs(9, -1.5, ((9, -1.5),)),)
    unread = RequestOutput("r", (5,), (9,), (9,), "nine", "nine", False, None, 0.0, None, None, None,
                           logprobs=logprobs)

    async def read():
        stream = RequestStream("r", Tier.STANDARD)
        stream.put(unread)
        stream.put(StreamEnd("abort", "shut down"))
        stream.put(unread)  # nothing replaces the end
        return [item async for item in stream]

    (end,) = asyncio.run(read())
    assert end == StreamEnd("abort", "shut down", text="nine", logprobs=logprobs, token_ids=(9,))


class RecordingListener:
    """Records what the async engine reports, by event."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.events.append((name, *args))


def test_the_listener_hears_each_admission_rejection_output_and_finish(served):
    from scheduler.request import Tier

    async def scenario():
        listener = RecordingListener()
        async_engine = AsyncLLMEngine(served, listener=listener)
        await async_engine.start()
        with pytest.raises(ValueError, match="empty"):
            await async_engine.submit("bad", [], "", GREEDY6)
        stream = await async_engine.submit("good", [5, 6, 7], "text", GREEDY6, tier=Tier.INTERACTIVE)
        outputs = await asyncio.wait_for(collect(stream), 60)
        await async_engine.shutdown()
        return listener.events, outputs

    events, outputs = asyncio.run(scenario())
    names = [event[0] for event in events]
    assert names[0] == "on_rejected" and isinstance(events[0][2], ValueError)
    assert events[1] == ("on_admitted", Tier.INTERACTIVE, 3)
    assert names.count("on_output") == len(outputs) and names[-1] == "on_finished"
    assert events[-1][1] is outputs[-1] and "on_aborted" not in names


def test_an_idle_engine_thread_renews_its_stats_when_no_command_comes(served, monkeypatch):
    from engine import engine_worker

    monkeypatch.setattr(engine_worker, "IDLE_STATS_REFRESH_S", 0.01)
    worker = AsyncLLMEngine(served)._worker
    before = worker.stats
    assert worker.run_commands(block=True) is True  # nothing queued: it waited, then went on
    assert worker.stats is not before


def test_a_drain_past_its_grace_aborts_each_running_stream_once_and_forgets_it(served):
    async def scenario():
        listener = RecordingListener()
        async_engine = AsyncLLMEngine(served, listener=listener)
        await async_engine.start()
        long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        stream = await async_engine.submit("long", [5, 6, 7], "text", long)
        first = await stream.__anext__()
        await async_engine.drain(grace_s=0)
        left = dict(async_engine._streams)  # right after the drain, before the shutdown's sweep
        rest = await collect(stream)
        await async_engine.shutdown(grace_s=0)
        return first, left, rest, listener.events

    first, left, rest, events = asyncio.run(scenario())
    assert not first.finished and left == {}
    assert rest[-1].reason == "abort"
    assert [event[:2] for event in events if event[0] == "on_aborted"] == [("on_aborted", "long")]
    free, total = served.scheduler.block_manager.num_free_blocks, served.scheduler.block_manager.num_total_blocks
    assert free == total and not served.has_unfinished_requests()


def test_overlap_without_a_predictor_serves_from_the_engine_thread_alone(served):
    # A GPU server asks for overlap; with no predictor there is nothing to overlap, and no
    # predictor thread may stand between a submission and the engine.
    async def scenario():
        async_engine = AsyncLLMEngine(served, overlap_prediction=True)
        await async_engine.start()
        threads = len(async_engine._threads)
        stream = await asyncio.wait_for(async_engine.submit("plain", [5, 6, 7], "text", GREEDY6), 30)
        outputs = await asyncio.wait_for(collect(stream), 60)
        await async_engine.shutdown()
        return threads, outputs

    threads, outputs = asyncio.run(scenario())
    assert threads == 1 and outputs[-1].finished and len(outputs[-1].token_ids) == 6
