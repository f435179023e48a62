"""What a mutation run of the Triton kernels, their launch and input checks, the engine config and
a few CLI helpers found untested: layouts the kernels accept but the tests never passed (strided q,
K and V caches laid out differently, a block table sliced out of a wider one, non-power-of-two
head sizes), the edges of the launch heuristics and of the argument checks, and the arrival
predictor's batching. Kernel shapes are tiny: under the interpreter every loop iteration costs
milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import queue

import pytest
import torch

from engine import arg_types
from engine.arrival_predictor import ArrivalPredictor
from engine.attention import reference
from engine.config import EngineConfig
from engine.engine_commands import Submission
from engine.kernels import launch
from engine.kernels.cases import MIXED_SEQS, TOLERANCE, AttentionCase, make_batch
from engine.kernels.launch import LaunchConfig, _auto_splits, next_power_of_2, resolve
from scheduler.request import SEED_MAX, SEED_MIN, SamplingParams, Tier
from test_kernels import DEVICE, _max_error, kernels, poison_unused_slots  # noqa: F401 - kernels: the fixture

# ---------------------------------------------------------------- paged attention: layouts


def _restrided(t: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values as a view whose rows are `pad` elements wider than the last dim."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _slot_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored [block_size, num_blocks, ...]: other block and slot strides."""
    return cache.transpose(0, 1).contiguous().transpose(0, 1)


def test_attention_reads_views_and_differently_laid_out_caches_through_their_strides(kernels):
    # q as a view with wider rows (a fused projection's slice, NaN past head_dim, which the padded
    # lanes must not load), V stored slot-major next to a
    # block-major K, and a block table sliced out of a wider one (stride(0) > its width): the
    # wrapper passes every stride, so each must reach the kernel, and out is dense.
    case = AttentionCase("views", ((9, 9), (21, 1)), group=2, block_size=8, head_dim=24)
    batch = make_batch(case, DEVICE)
    expected = reference.paged_attention(*batch.args())
    wide_table = torch.zeros(batch.block_tables.shape[0], batch.block_tables.shape[1] + 5, dtype=torch.int32,
                             device=DEVICE)
    wide_table[:, :batch.block_tables.shape[1]] = batch.block_tables
    q = _restrided(batch.q, pad=16)
    v_cache = _slot_major(batch.v_cache)
    assert q.stride(1) != q.shape[2] and v_cache.stride() != batch.k_cache.stride()
    out = kernels.attention(q, batch.k_cache, v_cache, wide_table[:, :batch.block_tables.shape[1]],
                            batch.seq_lens, batch.query_start_loc, batch.scale)
    assert out.is_contiguous() and _max_error(out, expected) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize("launch_config", [None, LaunchConfig(block_n=16, num_splits=2)], ids=["one-split", "splits2"])
def test_padded_head_dims_and_split_tails_never_touch_unused_slots(kernels, launch_config):
    # head_dim 24 is padded to 32 lanes: the padding must read nothing (the last KV head's padding
    # would be the next slot's first values); the splits must cover all 33 keys of the last
    # sequence (two of 16 would not) and stop at the context's end.
    case = AttentionCase("pad-nan", ((23, 23), (9, 1), (33, 1)), group=3, head_dim=24)
    batch = make_batch(case, DEVICE)
    clean = reference.paged_attention(*batch.args())
    poison_unused_slots(batch, case)
    out = kernels.attention(*batch.args(), launch=launch_config)
    assert _max_error(out, clean) <= TOLERANCE[case.dtype]


def test_a_batch_without_tokens_returns_an_empty_output(kernels):
    batch = make_batch(AttentionCase("empty", ((4, 1),)), DEVICE)
    no_tokens = torch.zeros(2, dtype=torch.int32, device=DEVICE)  # one sequence with no query this step
    out = kernels.attention(batch.q[:0], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            no_tokens, batch.scale)
    assert out.shape == (0, *batch.q.shape[1:])


# ---------------------------------------------------------------- paged attention: input checks


def _ok_inputs():
    batch = make_batch(AttentionCase("checks", ((5, 2), (9, 1)), group=2), DEVICE)
    return dict(zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"), batch.args()[:6]))


def _attention_refusals(ok: dict) -> list[tuple[dict, str]]:
    k_cache = ok["k_cache"]
    return [
        ({"seq_lens": ok["seq_lens"].long()}, "seq_lens must be torch.int32"),
        ({"query_start_loc": ok["query_start_loc"].long()}, "query_start_loc must be torch.int32"),
        ({"seq_lens": ok["seq_lens"][:, None]}, r"seq_lens must have 1 dims"),
        ({"block_tables": ok["block_tables"].t().contiguous().t()}, "block_tables must be contiguous"),
        ({"query_start_loc": ok["query_start_loc"][:-1]}, r"num_seqs \+ 1 = 3 entries, got 2"),
        ({"seq_lens": ok["seq_lens"].to("meta")}, "seq_lens is on meta"),
        ({"v_cache": ok["v_cache"].half()}, "v_cache dtype"),
        ({"v_cache": ok["v_cache"].transpose(2, 3).contiguous().transpose(2, 3)}, "v_cache must be contiguous"),
        ({"k_cache": k_cache[:, :0], "v_cache": ok["v_cache"][:, :0]}, "block_size must be a power of two, got 0"),
    ]


@pytest.mark.parametrize("index", range(9))
def test_attention_refuses_index_tensors_and_caches_it_cannot_read(kernels, index):
    ok = _ok_inputs()
    change, message = _attention_refusals(ok)[index]
    with pytest.raises(ValueError, match=message):
        kernels.attention(**{**ok, **change}, scale=0.1)


# ---------------------------------------------------------------- write_kv


def test_write_kv_handles_odd_shapes_views_and_differently_laid_out_caches(kernels):
    # 3 KV heads of 24 dims (both padded inside the kernel), 5 tokens (a partial program), k and v
    # views of different buffers, caches of different layouts, and slot_mapping a slice of a longer
    # buffer whose next entry names a real slot: only slot_mapping's 5 tokens may be written.
    gen = torch.Generator().manual_seed(2)
    num_tokens, kv_heads, head_dim, num_blocks, block_size = 5, 3, 24, 3, 4
    k_buffer = torch.randn(num_tokens + 3, kv_heads, head_dim + 8, generator=gen).to(DEVICE)
    k = k_buffer[:num_tokens, :, :head_dim]
    v = torch.randn(num_tokens, 2, kv_heads, head_dim, generator=gen).to(DEVICE)[:, 1]
    slot_buffer = torch.tensor([6, 0, 11, 3, 9, 1, 2], device=DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, -7.0, device=DEVICE)
    v_cache = _slot_major(torch.full(shape, -7.0, device=DEVICE))
    expected_k, expected_v = k_cache.clone(), v_cache.contiguous()  # the reference needs dense caches
    kernels.write_kv(k, v, k_cache, v_cache, slot_buffer[:num_tokens])
    reference.write_kv(k, v, expected_k, expected_v, slot_buffer[:num_tokens])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_moves_a_token_wider_than_one_program(kernels):
    # 2 heads x 2048 dims is more than ELEMENTS_PER_PROGRAM lanes: still one token per program.
    k = torch.randn(2, 2, 2048, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    caches = [torch.zeros(2, 1, 2, 2, 2048, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([1, 0], device=DEVICE)
    kernels.write_kv(k, -k, caches[0][0], caches[0][1], slots)
    reference.write_kv(k, -k, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])


def _write_refusals(k: torch.Tensor, cache: torch.Tensor) -> list[tuple[tuple, str]]:
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    return [
        ((k, k[:2], cache, cache.clone(), slots), r"v shape \(2, 2, 16\) != k shape"),
        ((k, k, cache, cache.clone(), slots[:2]), "slot_mapping has 2 entries for 3 tokens"),
        ((k, k, cache, cache.clone(), slots.to("meta")), "slot_mapping is on meta"),
        ((k, k.int(), cache, cache.clone(), slots), "v must be float16, bfloat16 or float32"),
    ]


@pytest.mark.parametrize("index", range(4))
def test_write_kv_refuses_mismatched_inputs(kernels, index):
    k = torch.zeros(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    args, message = _write_refusals(k, cache)[index]
    with pytest.raises(ValueError, match=message):
        kernels.write_kv(*args)


# ---------------------------------------------------------------- launch parameters


def test_next_power_of_2_rounds_up_and_keeps_powers():
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


@pytest.mark.parametrize("fields", [{"block_n": 0}, {"num_splits": 32}, {"num_stages": 0}, {"num_warps": 3}])
def test_launch_config_refuses_impossible_launches(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        LaunchConfig(**fields)


def test_launch_config_takes_its_largest_split_and_a_single_stage():
    assert LaunchConfig(num_splits=16, num_stages=1).num_splits == 16


def _plan(config: LaunchConfig, device: str = "cpu", **shape):
    fields = dict(num_seqs=1, num_kv_heads=1, group=1, max_query_len=1, max_seq_len=100)
    return resolve(config, device=torch.device(device), **{**fields, **shape})


def test_gpu_launches_need_16_wide_tiles_for_tl_dot():
    # Refused before any CUDA call, so this runs without a GPU; with the splits fixed the SM count
    # is never asked for, so a 16-wide launch resolves.
    with pytest.raises(ValueError, match=">= 16 on a GPU"):
        _plan(LaunchConfig(block_n=8, num_splits=1), device="cuda")
    assert _plan(LaunchConfig(block_n=16, block_m=16, num_splits=1), device="cuda").block_n == 16


def test_query_tiles_hold_16_rows_up_to_16_and_at_least_one_token():
    decode = _plan(LaunchConfig(), group=4, max_query_len=4)  # 4 tokens x 4 heads: one 16-row tile
    assert (decode.block_q, decode.num_q_blocks, decode.num_warps) == (4, 1, 4)
    prefill = _plan(LaunchConfig(), group=4, max_query_len=5)
    assert (prefill.block_q, prefill.num_q_blocks, prefill.num_warps) == (16, 1, 8)
    narrow = _plan(LaunchConfig(block_m=2), group=4, max_query_len=3)  # a tile always holds a whole group
    assert (narrow.block_q, narrow.num_q_blocks) == (1, 3)


def test_split_heuristic_edges():
    assert _auto_splits(programs=66, sms=132, iterations=32) == 2  # 132 programs fill 132 SMs
    assert _auto_splits(programs=1, sms=132, iterations=10**6) == 16  # never past MAX_SPLITS
    assert _auto_splits(programs=8, sms=132, iterations=24) == 4  # 8 splits would leave 3 iterations


def test_the_split_count_counts_a_partial_last_key_tile(monkeypatch):
    # 449 keys are 8 tiles of 64 (the last holds one key): two splits of 4 iterations each. The SM
    # count stands in for a GPU this machine may not have.
    monkeypatch.setattr(launch, "_count_sms", lambda device: 132)
    assert _plan(LaunchConfig(), device="cuda", max_seq_len=7 * 64 + 1).num_splits == 2
    assert _plan(LaunchConfig(), device="cuda", max_seq_len=7 * 64).num_splits == 1


def test_test_batches_keep_the_layout_their_docstring_promises():
    # The kernel tests rely on it: shuffled physical blocks, a padding column, spare garbage blocks.
    case = AttentionCase("layout", MIXED_SEQS)
    batch = make_batch(case)
    needed = [-(-seq_len // case.block_size) for seq_len, _ in case.seqs]
    used = torch.cat([batch.block_tables[b, :n] for b, n in enumerate(needed)])
    assert len(set(used.tolist())) == len(used) == sum(needed)
    assert batch.block_tables.shape[1] > max(needed)
    assert batch.k_cache.shape[0] > sum(needed)
    assert used.tolist() != sorted(used.tolist())


# ---------------------------------------------------------------- engine config


@pytest.mark.parametrize("fields", [
    {"swap_space_gib": 0}, {"seed": SEED_MIN}, {"seed": SEED_MAX}, {"dtype": "float16"}, {"num_threads": None},
    {"preemption_mode": "swap"},  # the default host pool holds swapped blocks
])
def test_engine_config_takes_its_edge_values(fields):
    assert all(getattr(EngineConfig(**fields), name) == value for name, value in fields.items())


@pytest.mark.parametrize("field, value", [("swap_space_gib", -1.0), ("num_gpu_blocks", 0), ("num_threads", 0)])
def test_engine_config_refuses_values_past_its_edges(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


# ---------------------------------------------------------------- argument types


def test_cpu_threads_takes_every_cpu_of_the_process():
    cpus = len(os.sched_getaffinity(0))
    assert arg_types.cpu_threads(str(cpus)) == cpus
    with pytest.raises(argparse.ArgumentTypeError, match=f"gives {cpus} CPUs"):
        arg_types.cpu_threads(str(cpus + 1))


@pytest.mark.parametrize("parse, text", [
    (arg_types.api_key, "  "), (arg_types.file_stem, ".."), (arg_types.file_stem, "x" * 240),
    (arg_types.power_of_two, "6"), (arg_types.tier_weights, "0,0,0"), (arg_types.tier_weights, "1,1,1,1"),
    (arg_types.cors_origin, "localhost:3000"), (arg_types.policy_list, " , "),
    (arg_types.checked_by(float, "number"), "junk"), (arg_types.positive_float_list, "1,0"),
])
def test_argument_types_refuse_values_with_a_usage_error(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def test_a_bad_number_list_is_named_as_a_list_not_by_the_types_name():
    # argparse said "invalid positive_float_list value: '0.5,abc'".
    for text in ("0.5,abc", "0.5,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be comma-separated positive numbers, got {text}"):
            arg_types.positive_float_list(text)


def test_argument_types_take_their_edge_values():
    assert arg_types.file_stem("x" * 239) == "x" * 239
    assert arg_types.power_of_two("8") == 8
    assert arg_types.positive_float_list("") == [] and arg_types.positive_float_list("1,,2") == [1.0, 2.0]
    assert arg_types.tier_weights("0,1,0") == [0.0, 1.0, 0.0]


def test_an_output_file_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="--json"):
        arg_types.check_output_location(tmp_path, "--json", folder=False)


# ---------------------------------------------------------------- arrival predictor


def _submissions(*texts: str) -> list[Submission]:
    params = SamplingParams(max_tokens=4)
    return [Submission(f"r{i}", [1], text, params, Tier.STANDARD, 0, 0.0) for i, text in enumerate(texts)]


def chars_predictor():
    from test_server import chars_predictor  # the server stack: imported only where needed

    return chars_predictor()


class Recording:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def predict(self, prompts):
        self.batches.append(list(prompts))
        return chars_predictor().predict(prompts)


@pytest.mark.parametrize("error", [RuntimeError("broken"), SystemExit(3)], ids=["error", "exit"])
def test_a_failing_predictor_leaves_the_batch_unpredicted(error):
    class Failing:
        def predict(self, prompts):
            raise error

    latencies = []
    batch = _submissions("a", "b")
    ArrivalPredictor(Failing(), lambda *latency: latencies.append(latency)).predict_batch(batch)
    assert [s.prediction for s in batch] == [None, None] and latencies == []


def _run_into(predictor: ArrivalPredictor, arrivals: queue.SimpleQueue, commands: queue.SimpleQueue) -> None:
    """Run the predictor thread's loop, handing what it scores to `commands` (an engine thread
    that takes everything)."""
    predictor.run(arrivals, lambda submission: commands.put(submission) is None,
                  lambda submission: pytest.fail(f"{submission.request_id} refused"))


def test_run_scores_at_most_max_batch_at_a_time_and_skips_cancelled():
    arrivals, commands = queue.SimpleQueue(), queue.SimpleQueue()
    subs = _submissions("a", "bb", "ccc", "dddd", "eeeee")
    subs[2].admitted.cancel()  # aborted while it waited: neither scored nor passed on
    for item in (*subs, None, None):  # the second stop only ends a mutant that missed the first
        arrivals.put(item)
    recording = Recording()
    _run_into(ArrivalPredictor(recording, lambda *latency: None, max_batch=2), arrivals, commands)
    assert recording.batches == [["a", "bb"], ["dddd"], ["eeeee"]]
    forwarded = [commands.get_nowait() for _ in range(commands.qsize())]
    assert [s.prompt_text for s in forwarded] == ["a", "bb", "dddd", "eeeee"]


def test_inline_the_engine_thread_steps_between_two_predictor_batches_of_a_burst():
    # A burst scored in one call froze every running stream for its whole prediction (seconds for
    # hundreds of prompts on this CPU); the batch bound held only on the predictor thread.
    from engine.engine_commands import Abort
    from engine.engine_worker import EngineWorker

    events: list[str] = []

    class Engine:
        def add_request(self, request_id, *args, **kwargs):
            events.append(f"add {request_id}")

        def abort_request(self, request_id):
            events.append(f"abort {request_id}")

        def stats(self):
            return None

        def charge_time_between_steps(self, seconds):
            pass

    class Predictor(Recording):
        def predict(self, prompts):
            events.append(f"predict {len(prompts)}")
            return super().predict(prompts)

    commands = queue.SimpleQueue()
    subs = _submissions("a", "bb", "ccc", "dddd", "eeeee")
    for command in (*subs[:3], Abort("r0"), *subs[3:]):
        commands.put(command)
    worker = EngineWorker(Engine(), commands, ArrivalPredictor(Predictor(), lambda *latency: None, max_batch=2),
                          on_outputs=lambda outputs: None, on_failure=lambda message: None)
    rounds = 0
    while not commands.empty():
        assert worker.run_commands(block=False)
        assert worker.busy_since is None  # between two predictions: not stuck in one
        events.append("step")
        rounds += 1
    assert events == ["predict 2", "add r0", "add r1", "step",
                      "predict 2", "add r2", "abort r0", "add r3", "step",  # in the order queued
                      "predict 1", "add r4", "step"]
    assert rounds == 3


def test_a_predictor_batch_of_none_is_refused():
    with pytest.raises(ValueError, match="max_predict_batch must be at least 1"):
        ArrivalPredictor(Recording(), lambda *latency: None, max_batch=0)


def test_run_returns_at_the_first_stop_even_with_submissions_beside_it():
    arrivals, commands = queue.SimpleQueue(), queue.SimpleQueue()
    first, later = _submissions("a", "b")
    for item in (first, None, later, None, None):  # the later ones would be a mutant's next rounds
        arrivals.put(item)
    _run_into(ArrivalPredictor(Recording(), lambda *latency: None, max_batch=2), arrivals, commands)
    assert commands.get_nowait() is first and commands.empty()
    assert arrivals.get_nowait() is later


def test_what_an_ended_engine_thread_no_longer_takes_is_refused():
    # A predictor thread that a shutdown left behind put its batch on a queue nobody read.
    arrivals, refused = queue.SimpleQueue(), []
    first, second = _submissions("a", "b")
    for item in (first, second, None):
        arrivals.put(item)
    ArrivalPredictor(Recording(), lambda *latency: None).run(arrivals, lambda submission: False, refused.append)
    assert refused == [first, second]


# ---------------------------------------------------------------- lengthwise generate


def _generate_json(capsys, argv: list[str]) -> list[dict]:
    from training.cli import main

    assert main(["generate", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_generate_prints_the_offline_apis_greedy_completions(capsys, tiny_model_dir):
    from engine.llm import LLM

    llm = LLM(str(tiny_model_dir), kv_cache_memory_gib=0.01)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    templated = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in ("", "hi")]
    expected = [out.text for out in llm.generate(templated, greedy)]
    raw_expected = llm.generate(["hi"], greedy)[0].text
    model = ["--model", str(tiny_model_dir), "--max-tokens", "3", "--ignore-eos", "--kv-cache-memory", "0.01"]
    # An empty message is still a templated prompt; the default temperature is greedy.
    rows = _generate_json(capsys, ["", "hi", *model])
    assert [(r["prompt"], r["text"], r["num_tokens"], r["finish_reason"]) for r in rows] == [
        ("", expected[0], 3, "length"), ("hi", expected[1], 3, "length")]
    # top-p that keeps one token samples the greedy token at any temperature.
    rows = _generate_json(capsys, ["hi", "--raw", *model, "--temperature", "1", "--top-p", "1e-9"])
    assert [r["text"] for r in rows] == [raw_expected]
    # --n: each prompt's choices in order, choice i drawn with seed + i as the offline API draws it.
    drawn = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=5, n=2)
    expected = [(choice.index, choice.text) for out in llm.generate(["hi", "yo"], drawn) for choice in out.outputs]
    rows = _generate_json(capsys, ["hi", "yo", "--raw", *model, "--temperature", "1", "--seed", "5", "--n", "2"])
    assert [(r["prompt"], r["index"], r["text"]) for r in rows] == [
        (prompt, index, text) for prompt, (index, text) in zip(["hi", "hi", "yo", "yo"], expected)]


def test_generate_warns_that_greedy_choices_are_alike(capsys, caplog, tiny_model_dir):
    model = ["--model", str(tiny_model_dir), "--max-tokens", "2", "--kv-cache-memory", "0.01"]
    rows = _generate_json(capsys, ["hi", "--raw", *model, "--n", "2"])
    assert rows[0]["text"] == rows[1]["text"]
    assert "--n 2 at temperature 0: greedy choices are all alike" in caplog.text


@pytest.mark.integration
def test_generate_ignore_eos_runs_past_the_models_own_stop(capsys, real_model_dir):
    # SmolLM2 answers this in three tokens and stops; --ignore-eos must carry it to --max-tokens.
    argv = ["Reply with one word: yes or no?", "--model", str(real_model_dir), "--max-tokens", "5",
            "--kv-cache-memory", "0.05"]
    [stopped] = _generate_json(capsys, argv)
    assert stopped["finish_reason"] == "stop" and stopped["num_tokens"] < 5
    [ignored] = _generate_json(capsys, [*argv, "--ignore-eos"])
    assert (ignored["finish_reason"], ignored["num_tokens"]) == ("length", 5)


# ---------------------------------------------------------------- scheduler flags


def _scheduler_flags(argv: list[str]) -> argparse.Namespace:
    from engine.scheduler_args import add_scheduler_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_scheduler_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [["--batch-shed-share", "0"], ["--max-queued-tokens", "0"]])
def test_admission_bounds_refuse_a_share_or_queue_of_zero(argv):
    with pytest.raises(argparse.ArgumentError, match=argv[0]):
        _scheduler_flags(["--admission", *argv])


def test_admission_reads_either_slo_whatever_the_policy():
    from engine.scheduler_args import scheduler_options

    args = _scheduler_flags(["--admission", "--slo-ttft-interactive", "0.5", "--slo-e2e-standard", "9"])
    assert scheduler_options(args, ["fcfs"]) == {"enable_admission": True, "slo_ttft_interactive_s": 0.5,
                                                 "slo_e2e_standard_s": 9.0}
