"""The offline API's input validation, stop conditions, seeds and request lifecycle."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.llm import LLM
from hf_reference import stop_string_past_the_middle
from scheduler.request import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=64, num_gpu_blocks=64,
               num_threads=1)


PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ("word " * 200, SamplingParams(), "longer than the context"),
    ([5] * 128, SamplingParams(), "longer than the context"),
    ([49152], SamplingParams(), "token ids"),
    # Not prompts at all: these were TypeErrors ("'NoneType' object is not iterable"), and True
    # was token 1.
    (None, SamplingParams(), "a prompt is a string or a list of token ids, got NoneType"),
    (5.0, SamplingParams(), "a prompt is a string or a list of token ids, got float"),
    ([True, 3], SamplingParams(), "token ids"),
    (PROMPT, {"max_tokens": 0}, "max_tokens"),
    (PROMPT, {"max_tokens": -3}, "max_tokens"),
    (PROMPT, {"top_p": 0.0}, "top_p"),
    (PROMPT, {"top_p": 1.5}, "top_p"),
    # Wrong types fail here, before anything runs, not as a TypeError inside an engine step.
    (PROMPT, {"seed": 1.5}, "seed"),
    (PROMPT, {"temperature": "1"}, "temperature"),
    (PROMPT, {"top_p": "0.5"}, "top_p"),
    (PROMPT, {"max_tokens": True}, "max_tokens"),
    (PROMPT, {"top_k": 2.5}, "top_k"),
    (PROMPT, {"stop": [3]}, "stop"),
    (PROMPT, {"stop_token_ids": 3}, "stop_token_ids"),
    (PROMPT, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (PROMPT, {"temprature": 0.5}, "temprature"),
])
def test_bad_input_raises_a_clear_value_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, prompt], params)
    # Nothing of the rejected batch stays queued.
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts", [None, 5])
def test_prompts_that_are_no_list_of_prompts_are_a_value_error(llm, prompts):
    with pytest.raises(ValueError, match="prompts must be a string, a list of token ids, a prompt mapping"):
        llm.generate(prompts)


def test_vllms_prompt_mappings_are_their_text_or_ids(llm):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    plain = [o.token_ids for o in llm.generate([PROMPT, ids], greedy(4), use_tqdm=False)]
    mapped = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], sampling_params=greedy(4))
    assert [o.token_ids for o in mapped] == plain
    assert llm.generate({"prompt": PROMPT}, greedy(4))[0].token_ids == plain[0]  # one mapping, one prompt
    # A TokensPrompt may name the text its ids came from: the ids are the prompt.
    named = llm.generate({"prompt_token_ids": ids[:3], "prompt": PROMPT}, greedy(4))[0]
    assert named.prompt_token_ids == tuple(ids[:3])
    for bad in ({"a": 1}, {"prompt": PROMPT, "multi_modal_data": {}}, {}, {"cache_salt": "t"}):
        with pytest.raises(ValueError, match="a prompt mapping holds prompt or prompt_token_ids"):
            llm.generate([PROMPT, bad], greedy(4))
    # Each key holds its own kind: a mapping inside one lost its salt, and ids passed as a text.
    for bad, message in (({"prompt": {"prompt_token_ids": ids, "cache_salt": "x"}}, "must be a text"),
                         ({"prompt": ids}, "must be a text"), ({"prompt_token_ids": PROMPT}, "must be a list")):
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPT, bad], greedy(4))
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_mappings_cache_salt_keeps_its_prompt_from_others_cached_blocks(tiny_model_dir):
    # vLLM puts cache_salt in the prompt mapping (it was refused there, with advice to move it).
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, scheduler_options={"enable_prefix_caching": True})
    prompt = PROMPT * 3  # several full blocks
    first, again = (llm.generate(prompt, greedy(2))[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    salted = llm.generate({"prompt": prompt, "cache_salt": "tenant-b"}, greedy(2))[0]
    assert salted.num_cached_tokens == 0 and salted.token_ids == first.token_ids
    # Two salts for one prompt are refused, not one silently chosen.
    with pytest.raises(ValueError, match="cache_salt 'a' in a prompt mapping, and 'b' in its SamplingParams"):
        llm.generate({"prompt": prompt, "cache_salt": "a"}, SamplingParams(cache_salt="b"))
    assert not llm.engine.has_unfinished_requests()


def test_numpy_numbers_and_arrays_are_taken_as_pythons(llm):
    # A tokenizer's return_tensors="np" and np.linspace sweeps give NumPy types; they were refused
    # with messages that said the values were not integers or not numbers.
    import numpy as np

    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = llm.generate(ids, greedy(4), use_tqdm=False)[0].token_ids
    for prompt in (np.array(ids), [np.int64(i) for i in ids], [np.array(ids)]):
        assert llm.generate(prompt, greedy(4), use_tqdm=False)[0].token_ids == expected
    assert len(llm.generate(np.array([ids[:4], ids[:4]]), greedy(2), use_tqdm=False)) == 2  # one per row
    params = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(5), seed=np.uint64(7),
                            stop_token_ids=[np.int64(3)], logit_bias={np.int64(2): np.float32(1.5)})
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)
    assert type(params.stop_token_ids[0]) is int and params.logit_bias == ((2, 1.5),)
    python = SamplingParams(max_tokens=4, temperature=0.5, top_k=5, seed=7, stop_token_ids=[3], logit_bias={2: 1.5})
    assert params == python
    arrays = SamplingParams(stop_token_ids=np.array([3, 4]), allowed_token_ids=np.arange(5), stop=np.array(["."]))
    assert (arrays.stop_token_ids, arrays.allowed_token_ids, arrays.stop) == ((3, 4), (0, 1, 2, 3, 4), (".",))
    assert type(arrays.allowed_token_ids[0]) is int
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=np.float64(4.0))  # still no integer
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        SamplingParams(ignore_eos=np.int64(1))


def test_priorities_order_the_prompts_under_the_priority_policy(tiny_model_dir):
    import numpy as np

    one_seat = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=1, num_threads=1, policy="priority")
    outputs = one_seat.generate(["a", "b", "c"], greedy(2), priority=[2, -1, 0])
    order = sorted(range(3), key=lambda i: outputs[i].first_scheduled_time)
    assert order == [1, 2, 0]
    outputs = one_seat.generate(["a", "b", "c"], greedy(2), priority=np.array([2, -1, 0]))  # NumPy's too
    assert sorted(range(3), key=lambda i: outputs[i].first_scheduled_time) == [1, 2, 0]
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        one_seat.generate(["a", "b", "c"], greedy(2), priority=[0, 1])


def test_priorities_under_another_policy_are_refused_not_ignored(llm):
    with pytest.raises(ValueError, match="schedules by fcfs, not by priority"):
        llm.generate(["a", "b"], greedy(2), priority=[1, 0])
    assert len(llm.generate(["a", "b"], greedy(2), priority=[0, 0])) == 2  # all 0: nothing to ignore


def test_max_tokens_none_runs_to_the_end_of_the_context(llm):
    ids = list(range(100, 110))
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    out = llm.generate(ids, params)[0]
    assert (len(out.token_ids), out.finish_reason) == (128 - len(ids), "length")  # max_model_len 128
    # A min_tokens beyond what None resolves to runs to the end of the context, as vLLM's offline
    # engine runs it (the server refuses it, as vLLM's does: test_server_protocol).
    capped = llm.generate(ids, SamplingParams(max_tokens=None, min_tokens=119, temperature=0.0))[0]
    assert (len(capped.token_ids), capped.finish_reason) == (128 - len(ids), "length")
    assert not llm.engine.has_unfinished_requests()


def test_seed_minus_one_is_no_seed_as_in_vllm(llm):
    assert SamplingParams(seed=-1).seed is None
    hot = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=-1)
    draws = {llm.generate(PROMPT, hot)[0].token_ids for _ in range(3)}
    assert len(draws) > 1  # three unseeded draws of 12 tokens from a random model: alike by chance never
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1.0)


@pytest.mark.parametrize("field, value, message", [
    ("priority", "a", "priority must be an integer"), ("priority", 1.5, "priority must be an integer"),
    ("arrival_time", "x", "arrival_time must be a finite number"),
    ("arrival_time", float("nan"), "arrival_time must be a finite number"),
])
def test_add_request_refuses_a_priority_or_arrival_time_the_policies_cannot_sort(llm, field, value, message):
    # A string priority was a TypeError from a comparison; a string or NaN arrival time was queued
    # and broke (or silently skewed) the policy's sort once another request arrived.
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [5, 6], SamplingParams(max_tokens=2), **{field: value})
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_reject_bad_values_directly():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.01)
    # None means none, as in a JSON body.
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    # vLLM's -1 disables top-k, as 0 does; below that is an error.
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_a_tuple_of_token_ids_is_one_prompt(llm):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    as_tuple, as_list = llm.generate(tuple(ids), greedy(4)), llm.generate(ids, greedy(4))
    assert len(as_tuple) == 1 and as_tuple[0].token_ids == as_list[0].token_ids


def greedy(max_tokens: int = 24, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def test_stop_string_cuts_text_and_finishes(llm):
    full = llm.generate(PROMPT, greedy())[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    stop = stop_string_past_the_middle(full.text, 3)
    stopped = llm.generate(PROMPT, greedy(stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    assert list(stopped.token_ids) == list(full.token_ids[:len(stopped.token_ids)])


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    full = llm.generate(PROMPT, greedy())[0]
    before_last = llm.engine.tokenizer.decode(full.token_ids[:-1])
    # The shortest suffix of the text that occurs nowhere earlier; it ends in the last token.
    stop = next(full.text[-n:] for n in range(1, len(full.text) + 1)
                if full.text.find(full.text[-n:]) == len(full.text) - n)
    assert not before_last.endswith(stop) and stop not in before_last
    stopped = llm.generate(PROMPT, greedy(stop=(stop,)))[0]
    assert (stopped.finish_reason, len(stopped.token_ids)) == ("stop", 24)
    assert stopped.text == full.text[:-len(stop)]


def test_stop_token_id_finishes_at_its_first_occurrence(llm):
    full = llm.generate(PROMPT, greedy())[0]
    tokens = list(full.token_ids)
    first = next(i for i in range(5, len(tokens)) if tokens.index(tokens[i]) == i)  # not seen before i
    stopped = llm.generate(PROMPT, greedy(stop_token_ids=(tokens[first],)))[0]
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == tokens[:first + 1]
    # As in vLLM, the stop token is not in the text (it is in token_ids and usage).
    assert stopped.text == llm.tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert llm.tokenizer.decode([tokens[first]], skip_special_tokens=True).strip()  # a token with text


def test_a_stop_string_inside_a_kept_stop_token_is_the_stop_reason(llm):
    # vLLM's output processor: a stop string its detokenizer finds overrides the token's reason.
    tokens = list(llm.generate(PROMPT, greedy())[0].token_ids)
    first = next(i for i in range(5, len(tokens)) if tokens.index(tokens[i]) == i
                 and llm.tokenizer.decode([tokens[i]], skip_special_tokens=True).strip())
    word = llm.tokenizer.decode([tokens[first]], skip_special_tokens=True).strip()
    both = dict(stop_token_ids=(tokens[first],), stop=(word,))
    kept = llm.generate(PROMPT, greedy(include_stop_str_in_output=True, **both))[0]
    assert (kept.finish_reason, kept.stop_reason, len(kept.token_ids)) == ("stop", word, first + 1)
    assert kept.text.endswith(word)
    dropped = llm.generate(PROMPT, greedy(**both))[0]  # the token's text is never searched
    assert (dropped.finish_reason, dropped.stop_reason) == ("stop", tokens[first])


def test_text_is_the_decoded_tokens(llm):
    out = llm.generate(PROMPT, greedy())[0]
    assert out.text == llm.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    in_batch = llm.generate(["Hello there", PROMPT, "Another prompt"], [others, seeded, others])[1].token_ids
    assert alone == in_batch
    different = llm.generate(PROMPT, replace(seeded, seed=8))  # the seed alone changed
    assert different[0].token_ids != alone


def step_through_failures(engine, failure: type[BaseException]) -> dict[str, tuple[int, ...]]:
    """Step until nothing is left, going on past failed steps; the finished token ids by request.
    Bounded: a request stranded by a failed step fails the test instead of hanging it."""
    finished = {}
    for _ in range(200):
        try:
            finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        except failure:
            continue
        if not engine.has_unfinished_requests():
            break
    return finished


def test_a_failed_step_that_had_sampled_leaves_seeded_tokens_unchanged(llm, monkeypatch):
    seeded = [SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True) for seed in (1, 2)]
    expected = [o.token_ids for o in llm.generate([PROMPT, "Count to ten"], seeded)]
    engine, execute, calls = llm.engine, llm.engine.runner.execute, []

    def fails_after_sampling_on_the_fourth_step(*args):
        calls.append(1)
        result = execute(*args)  # the sampler has drawn this step's numbers
        if len(calls) == 4:
            raise RuntimeError("device error after sampling")
        return result

    monkeypatch.setattr(engine.runner, "execute", fails_after_sampling_on_the_fourth_step)
    for request_id, prompt, params in zip("xy", [PROMPT, "Count to ten"], seeded):
        engine.add_request(request_id, prompt, params)
    finished = step_through_failures(engine, RuntimeError)
    assert not engine.has_unfinished_requests()
    assert len(calls) > 4 and [finished["x"], finished["y"]] == expected


def test_a_step_that_fails_while_taking_its_tokens_strands_no_request(llm, monkeypatch):
    # Ctrl-C can land after the forward, while the sampled tokens are appended: some requests got
    # theirs, some did not. Recompute must finish each with the tokens an uninterrupted run gives.
    expected = [o.token_ids for o in llm.generate([PROMPT, "Count to ten"], greedy(12))]
    scheduler = llm.engine.scheduler
    update, calls = scheduler.update_from_output, []

    def fails_halfway_on_the_fourth_step(output, runner_output, now):
        calls.append(1)
        if len(calls) != 4:
            return update(output, runner_output, now)
        first = replace(output, chunks=output.chunks[:1])
        update(first, runner_output, now)  # the first request takes its token, then the failure
        raise KeyboardInterrupt

    monkeypatch.setattr(scheduler, "update_from_output", fails_halfway_on_the_fourth_step)
    engine = llm.engine
    for request_id, prompt in zip("xy", [PROMPT, "Count to ten"]):
        engine.add_request(request_id, prompt, greedy(12))
    finished = step_through_failures(engine, KeyboardInterrupt)
    assert len(calls) > 4 and [finished.get("x"), finished.get("y")] == expected
    stats = engine.stats().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks


def test_top_k_one_is_greedy(llm):
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, ignore_eos=True))
    assert sampled[0].token_ids == llm.generate(PROMPT, greedy(16))[0].token_ids


def test_abort_frees_everything(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT, greedy(50))
    engine.add_request("b", PROMPT, greedy(50))
    engine.step()
    engine.step()
    assert engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert {o.request_id for o in outputs} == {"b"}
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 50
    stats = engine.stats().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks
    # Neither the aborted nor the finished request leaves detokenizer state behind.
    assert engine.output_processor.num_tracked() == 0


def test_an_aborted_request_leaves_no_detokenizer_state(llm):
    engine = llm.engine
    llm.generate(PROMPT, greedy(4))
    assert engine.output_processor.num_tracked() == 0
    engine.add_request("a", PROMPT, greedy(50))
    engine.step()
    assert engine.abort_request("a")
    assert engine.output_processor.num_tracked() == 0
    assert not engine.has_unfinished_requests()


def test_an_interrupted_generate_frees_its_requests_and_a_failed_step_strands_none(llm, monkeypatch):
    engine = llm.engine
    expected = llm.generate([PROMPT, "Count to ten"], greedy(20))
    execute, calls = engine.runner.execute, []

    def interrupted_on_the_third_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return execute(*args)

    monkeypatch.setattr(engine.runner, "execute", interrupted_on_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "Count to ten"], greedy(20))
    stats = engine.stats().scheduler
    assert not engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks
    # Interrupted while still queueing the prompts: the ones already queued go too (before, they
    # stayed behind and ran in the next generate call).
    add_request, added = engine.add_request, []

    def interrupted_on_the_second_prompt(*args, **kwargs):
        added.append(1)
        if len(added) == 2:
            raise KeyboardInterrupt
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", interrupted_on_the_second_prompt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "Count to ten"], greedy(20))
    monkeypatch.setattr(engine, "add_request", add_request)
    assert not engine.has_unfinished_requests()
    # A step that fails under the engine's own loop leaves its requests to be recomputed, and
    # they finish with the tokens an uninterrupted run gives.
    calls.clear()
    engine.add_request("x", PROMPT, greedy(20))
    engine.add_request("y", "Count to ten", greedy(20))
    finished = {}
    for _ in range(200):
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            continue
        finished.update({o.request_id: o for o in outputs if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert [finished["x"].token_ids, finished["y"].token_ids] == [o.token_ids for o in expected]
    stats = engine.stats().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks


def test_streamed_text_adds_up_and_never_shows_a_stop_string(llm):
    full = llm.generate(PROMPT, greedy())[0]
    stop = stop_string_past_the_middle(full.text, 4)
    engine = llm.engine
    engine.add_request("streamed", PROMPT, greedy(stop=(stop,)))
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.new_text)
            assert output.text == "".join(pieces)
    assert "".join(pieces) == full.text[:full.text.index(stop)]
    assert sum(1 for piece in pieces if piece) > 2 and output.finish_reason == "stop"


@pytest.mark.parametrize("config_file", ["config.json", "generation_config.json"])
def test_every_end_id_of_the_checkpoint_stops_a_reply(tiny_model_dir, tmp_path, config_file):
    import json
    import shutil

    # The tiny model with its config naming a second end id: the token greedy decoding emits
    # fourth. A reply stops there (reason "stop"), unless ignore_eos.
    base = LLM(str(tiny_model_dir), max_model_len=128, num_gpu_blocks=64, num_threads=1)
    tokens = base.generate(PROMPT, greedy(8))[0].token_ids
    end_id = tokens[3]
    first = tokens.index(end_id)
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "two_ends")
    path = model_dir / config_file
    config = json.loads(path.read_text()) if path.exists() else {}
    config["eos_token_id"] = [base.engine.eos_token_id, end_id]
    path.write_text(json.dumps(config))
    llm = LLM(str(model_dir), max_model_len=128, num_gpu_blocks=64, num_threads=1)
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", tokens[:first + 1])
    assert llm.generate(PROMPT, greedy(8))[0].token_ids == tokens  # ignore_eos


def test_the_tokenizers_eos_token_ends_a_reply_unless_ignore_eos(llm, monkeypatch):
    # Every other test ignores eos; here the sampler is scripted to emit eos third.
    engine = llm.engine
    eos = engine.eos_token_id
    assert eos is not None
    script = [100, 200, eos, 300, 400, 500]
    prompt_len = len(engine.tokenizer.encode(PROMPT, add_special_tokens=False))

    def scripted(logits, positions, params):
        return [script[position - prompt_len] for position in positions]

    monkeypatch.setattr(engine.runner.sampler, "sample", scripted)
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert (stopped.finish_reason, list(stopped.token_ids)) == ("stop", [100, 200, eos])
    ignored = llm.generate(PROMPT, greedy(6))[0]
    assert (ignored.finish_reason, list(ignored.token_ids)) == ("length", script)


def test_a_step_record_sums_the_context_after_the_step(llm):
    # A 10-token prompt: its prefill leaves 10 tokens of context, its first decode 11.
    engine = llm.engine
    engine.add_request("ctx", list(range(100, 110)), greedy(3))
    engine.step()
    assert (engine.last_step.num_seqs, engine.last_step.num_batched_tokens) == (1, 10)
    assert engine.last_step.sum_context_tokens == 10
    engine.step()
    assert (engine.last_step.num_batched_tokens, engine.last_step.sum_context_tokens) == (1, 11)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_reply_cut_inside_a_character_by_max_tokens_keeps_its_text(llm, monkeypatch):
    # The sampler is scripted to emit an emoji's tokens cut short by max_tokens: the last step
    # decodes as final, so the reply's text is the full decode, U+FFFD included.
    engine = llm.engine
    ids = engine.tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]
    expected = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.startswith("ok ") and expected.endswith("\ufffd")
    prompt_len = len(engine.tokenizer.encode(PROMPT, add_special_tokens=False))
    monkeypatch.setattr(engine.runner.sampler, "sample",
                        lambda logits, positions, params: [ids[p - prompt_len] for p in positions])
    out = llm.generate(PROMPT, greedy(len(ids)))[0]
    assert (out.finish_reason, list(out.token_ids)) == ("length", ids)
    assert out.text == expected


def test_each_seeded_token_is_the_draw_at_its_own_position(llm, monkeypatch):
    # The runner hands the sampler each row's position in its sequence: a seeded token at output
    # index i is the draw, on the logits of that step, at position prompt_len + i.
    from engine.sampler import Sampler

    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    sample, seen = engine.runner.sampler.sample, []

    def recording(logits, positions, row_params):
        seen.append(logits.detach().float().cpu().clone())
        return sample(logits, positions, row_params)

    monkeypatch.setattr(engine.runner.sampler, "sample", recording)
    out = llm.generate(PROMPT, params)[0]
    prompt_len = len(out.prompt_token_ids)
    assert len(seen) == len(out.token_ids) == 8
    redrawn = [Sampler(seed=99).sample(logits, [prompt_len + i], [params])[0] for i, logits in enumerate(seen)]
    assert redrawn == list(out.token_ids)
    # Drawn at one position for all, the tokens would differ (the check has teeth).
    assert [Sampler(seed=99).sample(logits, [0], [params])[0] for logits in seen] != redrawn


def test_a_swap_space_smaller_than_a_block_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="swap_space_gib 1e-09 holds no KV block"):
        LLM(model=str(tiny_model_dir), preemption_mode="swap", swap_space_gib=1e-9)


def test_generate_scores_its_prompts_in_one_batch_and_serves_on_when_the_predictor_fails(llm, monkeypatch):
    # Each prompt had been scored alone, and a failing predictor failed the whole generate call,
    # where the server serves such requests with their lengths unknown.
    from predictor.base import Prediction

    class Recording:
        def __init__(self, error: Exception | None = None):
            self.calls: list[list[str]] = []
            self.error = error

        def predict(self, prompts):
            self.calls.append(list(prompts))
            if self.error is not None:
                raise self.error
            return [Prediction(point=5.0, p50=5.0, p90=9.0, score=5.0, rank_len=5.0) for _ in prompts]

    recording = Recording()
    monkeypatch.setattr(llm.engine, "predictor", recording)
    prompts = [PROMPT, "Count to ten", [5, 6, 7]]
    assert len(llm.generate(prompts, greedy(3))) == 3
    assert recording.calls == [[PROMPT, "Count to ten", llm.tokenizer.decode([5, 6, 7])]]
    failing = Recording(RuntimeError("predictor broke"))
    monkeypatch.setattr(llm.engine, "predictor", failing)
    outputs = llm.generate(prompts, greedy(3))
    assert [len(output.token_ids) for output in outputs] == [3, 3, 3]
    assert not llm.engine.has_unfinished_requests()


CHAT = [{"role": "user", "content": "Name a colour."}]


def test_chat_is_generate_on_the_chat_templated_prompt(llm):
    # vLLM's LLM.chat: it was missing, and the template reachable only through llm.engine.
    templated = llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = llm.generate(templated, greedy(4), use_tqdm=False)[0]
    chatted = llm.chat(CHAT, greedy(4), use_tqdm=False)
    assert len(chatted) == 1 and chatted[0].prompt_token_ids == expected.prompt_token_ids
    assert chatted[0].token_ids == expected.token_ids
    # A list of conversations is one result per conversation, in order.
    other = [{"role": "user", "content": "Count to three."}]
    both = llm.chat([other, CHAT], greedy(4), use_tqdm=False)
    assert [o.token_ids for o in both][1] == expected.token_ids and len(both) == 2
    assert llm.get_tokenizer() is llm.tokenizer


def test_chat_takes_messages_as_the_server_does(llm):
    # OpenAI's text parts were a template error, and a developer message a turn SmolLM2 knows not.
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a\ncolour."}]
    assert (llm.chat(parts, greedy(2), use_tqdm=False)[0].prompt_token_ids
            == llm.chat(plain, greedy(2), use_tqdm=False)[0].prompt_token_ids)


def test_chat_switches_as_vllm_has_them(llm):
    continued = [*CHAT, {"role": "assistant", "content": "Blue is"}]
    rendered = llm.tokenizer.apply_chat_template(continued, tokenize=False, continue_final_message=True)
    assert rendered.endswith("Blue is")  # the reply extends the last message, no new turn
    out = llm.chat(continued, greedy(2), add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out[0].prompt_token_ids == tuple(llm.tokenizer.encode(rendered, add_special_tokens=False))
    # The template's variables win over the switches, as vLLM merges them.
    by_kwargs = llm.chat(continued, greedy(2), chat_template_kwargs={"add_generation_prompt": False,
                                                                     "continue_final_message": True}, use_tqdm=False)
    assert by_kwargs[0].prompt_token_ids == out[0].prompt_token_ids


@pytest.mark.parametrize("messages, kwargs, message", [
    (CHAT, {"continue_final_message": True}, "add_generation_prompt and continue_final_message cannot both"),
    (CHAT, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set tokenize"),
    (CHAT, {"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be a mapping, got list"),
    ([], {}, "messages must be a conversation or a list of conversations"),
    ("hi", {}, "messages must be a conversation or a list of conversations"),
    ([CHAT, "hi"], {}, "messages must be a non-empty list of"),
    ([CHAT, []], {}, "messages must be a non-empty list of"),
    # Messages are checked as the server checks them, naming the first bad one.
    ([{"content": "no role"}], {}, "message 0: role: Field required"),
    ([*CHAT, {"role": "user", "content": [{"type": "image_url"}]}], {}, "message 1: content: content part 0 is of type"),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set messages"),
])
def test_bad_chats_are_value_errors_before_anything_is_queued(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, greedy(2), use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_vllms_outputs_idiom_reads_the_one_sequence(llm):
    # vLLM code reads out.outputs[0].text; it was an AttributeError.
    plain, scored = llm.generate([PROMPT, PROMPT], [greedy(4), greedy(4, logprobs=0)], use_tqdm=False)
    (sequence,) = plain.outputs
    assert (sequence.index, sequence.text, sequence.token_ids) == (0, plain.text, plain.token_ids)
    assert (sequence.finish_reason, sequence.stop_reason) == (plain.finish_reason, plain.stop_reason)
    assert sequence.cumulative_logprob is None and sequence.logprobs is None  # none asked for, as in vLLM
    summed = sum(entry.logprob for entry in scored.logprobs)
    assert scored.outputs[0].cumulative_logprob == pytest.approx(summed) and summed < 0
    assert scored.outputs[0].token_ids == plain.token_ids


def test_vllms_import_line_reads_from_the_engine_package_without_loading_torch_early() -> None:
    import subprocess
    import sys

    from engine import LLM as Exported, SamplingParams as ExportedParams

    assert (Exported, ExportedParams) == (LLM, SamplingParams)
    light = "import sys, engine, engine.arg_types; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", light], check=True)


def test_an_output_names_its_prompt_as_vllms_quickstart_reads_it(llm):
    # vLLM's quickstart prints output.prompt beside output.outputs[0].text: an AttributeError here.
    text, ids, templated = llm.generate([PROMPT, [5, 6, 7], {"prompt": "Count"}], greedy(2), use_tqdm=False)
    assert (text.prompt, ids.prompt, templated.prompt) == (PROMPT, None, "Count")
    conversation = [{"role": "user", "content": "hi"}]
    (chat,) = llm.chat(conversation, greedy(2), use_tqdm=False)
    assert chat.prompt == llm.engine.apply_chat_template(conversation, add_generation_prompt=True)


def test_n_choices_offline_are_the_seeded_draws_each_alone_gathered_in_one_output(llm):
    # vLLM's SamplingParams(n=3) gives one RequestOutput with three sequences; it was refused here.
    drawn = SamplingParams(n=3, max_tokens=8, temperature=1.0, ignore_eos=True, seed=7, prompt_logprobs=0)
    (gathered,) = llm.generate(PROMPT, drawn, use_tqdm=False)
    alone = [llm.generate(PROMPT, replace(drawn, n=1, seed=7 + index), use_tqdm=False)[0] for index in range(3)]
    assert [choice.index for choice in gathered.outputs] == [0, 1, 2]
    assert [choice.token_ids for choice in gathered.outputs] == [one.token_ids for one in alone]
    assert [choice.text for choice in gathered.outputs] == [one.text for one in alone]
    assert len({choice.token_ids for choice in gathered.outputs}) > 1  # seed + i: distinct draws
    assert gathered.request_id.startswith("offline-") and gathered.finished
    assert gathered.prompt_logprobs == alone[0].prompt_logprobs is not None  # scored once, for all
    stats = llm.engine.stats().scheduler
    assert not llm.engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def test_the_progress_bar_counts_prompts_not_choices_as_vllms_does(llm, capsys):
    llm.generate([PROMPT, "Count to ten"], SamplingParams(n=3, max_tokens=2), use_tqdm=True)
    bar = capsys.readouterr().err
    assert "2/2" in bar and "/6" not in bar


def test_n_per_prompt_follows_its_own_params_and_a_mapping_takes_n(llm):
    two, one = llm.generate([PROMPT, "Count to ten"], [{"n": 2, "max_tokens": 3, "temperature": 0},
                                                       greedy(3)], use_tqdm=False)
    assert len(two.outputs) == 2 and len(one.outputs) == 1
    assert two.outputs[0].token_ids == two.outputs[1].token_ids == llm.generate(PROMPT, greedy(3))[0].token_ids


@pytest.mark.parametrize("n", [0, -1, True, 1.5, None, "2"])
def test_n_that_is_no_positive_integer_is_refused_by_name(llm, n):
    with pytest.raises(ValueError, match=f"n must be a positive integer, got {n!r}"):
        llm.generate(PROMPT, {"n": n, "max_tokens": 2}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_engine_takes_one_sequence_per_request(llm):
    with pytest.raises(ValueError, match="n=2: an engine request is one sequence"):
        llm.engine.add_request("two", PROMPT, SamplingParams(n=2))
    assert not llm.engine.has_unfinished_requests()


def test_an_option_the_engine_lacks_is_a_value_error_naming_it(tiny_model_dir):
    # vLLM's tensor_parallel_size was a TypeError from the dataclass's constructor.
    with pytest.raises(ValueError, match="LLM: no option gpu_memory_utilization, tensor_parallel_size here"):
        LLM(str(tiny_model_dir), tensor_parallel_size=1, gpu_memory_utilization=0.9)
