"""Triton paged attention and KV write against the torch reference (engine/attention/reference.py).

Without CUDA the kernels run under the Triton interpreter. Triton decides compiled vs interpreted
when `@triton.jit` runs, i.e. when the kernel module is first imported, so the module-scoped
`kernels` fixture sets TRITON_INTERPRET=1 only while this file's tests run (restored afterwards,
so other test files see the environment they started with) and imports the kernel modules then;
a kernel module already imported in compiled form is re-imported under the interpreter. Once
interpreted, the kernels stay interpreted in this process, which is what any CPU caller needs.
(The kernels call only Triton builtins, so it does not matter that triton.language itself was
usually imported earlier, in compiled mode, by transformers.)
With CUDA (scripts/gpu_check.sh) the same tests run compiled on the GPU.
Shapes are small: the interpreter costs milliseconds per loop iteration.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention import reference
from training import bench_attention as bench
from engine.kernels.cases import CASES, MIXED_SEQS, TOLERANCE, AttentionCase, make_batch
from engine.kernels.launch import LaunchConfig, _auto_splits, resolve

ROOT = Path(__file__).resolve().parent.parent
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="module")
def kernels():
    with pytest.MonkeyPatch.context() as env:
        if not ON_GPU:
            env.setenv("TRITON_INTERPRET", "1")
        write_kv = importlib.import_module("engine.kernels.write_kv")
        paged = importlib.import_module("engine.kernels.paged_attention")
        if not ON_GPU and not paged.kernels_interpreted():
            write_kv = importlib.reload(write_kv)
            paged = importlib.reload(paged)
        yield SimpleNamespace(attention=paged.triton_paged_attention, write_kv=write_kv.triton_write_kv)


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_paged_attention_matches_reference(kernels, case):
    batch = make_batch(case, DEVICE)
    out = kernels.attention(*batch.args())
    expected = reference.paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert _max_error(out, expected) <= TOLERANCE[case.dtype]


LAUNCH_VARIANTS = [
    (AttentionCase("splits4", MIXED_SEQS, group=3), LaunchConfig(block_n=16, num_splits=4)),
    (AttentionCase("splits2-decode", ((5, 1), (90, 1)), group=4, block_size=32),
     LaunchConfig(block_n=16, num_splits=2)),
    (AttentionCase("tile-inside-block", MIXED_SEQS, block_size=32, group=2), LaunchConfig(block_n=16)),
    (AttentionCase("tile-over-8-blocks", MIXED_SEQS, block_size=4, group=3), None),
    (AttentionCase("query-tile-16", MIXED_SEQS, group=3), LaunchConfig(block_m=16)),
    (AttentionCase("head-dim-48", MIXED_SEQS, group=3, head_dim=48), None),
    (AttentionCase("mqa-8", ((3, 1), (40, 6)), num_kv_heads=1, group=8), None),
    (AttentionCase("bf16", MIXED_SEQS, group=3, dtype=torch.bfloat16), None),
]


@pytest.mark.parametrize("case, launch", [pytest.param(*v, id=v[0].name) for v in LAUNCH_VARIANTS])
def test_launch_variants_match_reference(kernels, case, launch):
    batch = make_batch(case, DEVICE)
    out = kernels.attention(*batch.args(), launch=launch)
    assert _max_error(out, reference.paged_attention(*batch.args())) <= TOLERANCE[case.dtype]


def poison_unused_slots(batch, case: AttentionCase) -> None:
    """NaN in every cache slot outside the sequences' contexts (spare blocks, partial-block tails)."""
    used = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, (seq_len, _) in enumerate(case.seqs):
        for pos in range(seq_len):
            used[batch.block_tables[b, pos // case.block_size], pos % case.block_size] = True
    batch.k_cache[~used] = float("nan")
    batch.v_cache[~used] = float("nan")


def test_unreferenced_cache_slots_are_never_read(kernels):
    case = AttentionCase("nan-garbage", MIXED_SEQS, group=3)
    batch = make_batch(case, DEVICE)
    clean = kernels.attention(*batch.args())
    poison_unused_slots(batch, case)
    poisoned = kernels.attention(*batch.args())
    assert torch.equal(poisoned, clean)


def test_hints_skip_the_sync_and_agree(kernels, monkeypatch):
    batch = make_batch(CASES[-1], DEVICE)
    unhinted = kernels.attention(*batch.args())
    paged = sys.modules[kernels.attention.__module__]
    monkeypatch.setattr(paged, "_max_lengths", lambda *args: pytest.fail("a hinted call synced to find the maxima"))
    hinted = kernels.attention(*batch.args(), max_query_len=23, max_seq_len=70)
    assert torch.equal(hinted, unhinted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_write_kv_matches_reference(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, head_dim = 37, 3, 64
    cache = torch.randn(2, 7, 16, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    # k and v as strided views of a fused projection, as the model produces them.
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    fused[3, 1, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])  # an overflowed key,
    fused[5, 2, 1, 7] = float("nan")  # and value: both backends store them as 0
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(7 * 16, generator=gen)[:num_tokens].to(DEVICE)
    expected = cache.clone()
    kernels.write_kv(k, v, cache[0], cache[1], slots)
    reference.write_kv(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)


def test_write_kv_stores_what_overflows_the_cache_type_as_zero_like_the_reference(kernels):
    k = torch.tensor([[[1.0, 1e5, 3e38, 2.0]]], device=DEVICE)  # finite in fp32, inf in fp16
    caches = [torch.zeros(2, 1, 4, 1, 4, device=DEVICE, dtype=torch.float16) for _ in range(2)]
    slots = torch.tensor([2], device=DEVICE)
    kernels.write_kv(k, k, caches[0][0], caches[0][1], slots)
    reference.write_kv(k, k, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1]) and torch.isfinite(caches[0]).all()


def test_write_kv_skips_negative_slots(kernels):
    k = torch.ones(3, 2, 16, device=DEVICE)
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kernels.write_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0], device=DEVICE))
    written = k_cache[:, :, 0, 0].flatten()
    assert written.tolist() == [1, 0, 0, 0, 0, 1, 0, 0]
    assert torch.equal(v_cache, 2 * k_cache)


def _bad_inputs():
    batch = make_batch(AttentionCase("bad", ((5, 2), (9, 1)), group=2), DEVICE)
    ok = dict(zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"),
                  batch.args()[:6]))
    return ok, [
        ({"block_tables": ok["block_tables"].long()}, "block_tables must be torch.int32"),
        ({"q": ok["q"][:, :3]}, "not a multiple of num_kv_heads"),
        ({"q": ok["q"][:, :, :16]}, "head_dim"),
        ({"q": ok["q"].half()}, "q dtype"),
        ({"q": ok["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        ({"v_cache": ok["v_cache"][:, :8]}, "v_cache shape"),
        ({"k_cache": ok["k_cache"][:, :12], "v_cache": ok["v_cache"][:, :12]}, "power of two"),
        ({"seq_lens": ok["seq_lens"][:1]}, "rows for 1 sequences"),
        ({"query_start_loc": ok["query_start_loc"] * 2}, "query_start_loc"),
        ({"q": ok["q"].int()}, "must be float16, bfloat16 or float32"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_rejects_bad_inputs_clearly(kernels, index):
    ok, cases = _bad_inputs()
    change, message = cases[index]
    with pytest.raises(ValueError, match=message):
        kernels.attention(**{**ok, **change}, scale=0.1)


def test_write_kv_rejects_bad_inputs(kernels):
    k = torch.zeros(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        kernels.write_kv(k, k, cache, cache.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache holds 2 heads"):
        kernels.write_kv(k[:, :1], k[:, :1], cache, cache.clone(), torch.zeros(3, dtype=torch.int64))


def test_split_heuristic_fills_the_gpu_but_keeps_work_per_split():
    assert _auto_splits(programs=512, sms=132, iterations=32) == 1  # bench shape on an H200
    assert _auto_splits(programs=256, sms=132, iterations=32) == 1
    assert _auto_splits(programs=64, sms=132, iterations=32) == 4
    assert _auto_splits(programs=8, sms=132, iterations=32) == 8  # few sequences: split until 4 iters
    assert _auto_splits(programs=8, sms=132, iterations=3) == 1  # short contexts: no split
    assert _auto_splits(programs=8, sms=None, iterations=1000) == 1  # the CPU interpreter
    plan = resolve(LaunchConfig(), device=torch.device("cpu"), num_seqs=4, num_kv_heads=2,
                   group=3, max_query_len=1, max_seq_len=100)
    assert (plan.group_pad, plan.block_q, plan.num_q_blocks, plan.num_splits) == (4, 4, 1, 1)


def test_launch_config_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="block_n"):
        LaunchConfig(block_n=48)


@pytest.mark.parametrize("name, gbps", [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0),
                                        ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA GH200 480GB", 4000.0),
                                        ("NVIDIA A100-SXM4-40GB", 1555.0), ("NVIDIA L40S", 864.0),
                                        ("Some Future GPU", None)])
def test_bench_peak_bandwidth_lookup(name, gbps):
    assert bench.peak_gbps(name, None) == gbps
    assert bench.peak_gbps(name, 1234.0) == 1234.0


def _small_bench_args(**overrides) -> SimpleNamespace:
    fields = dict(batch=3, context=40, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                  dtype="float32", peak_gbps=None, sweep="none", copy_mib=1)
    return SimpleNamespace(**{**fields, **overrides})


def test_bench_baseline_computes_the_same_attention():
    batch = bench.decode_batch(_small_bench_args(), DEVICE)
    k, v = bench.gather_contiguous(batch, 40)
    assert _max_error(bench.sdpa_decode(batch, k, v), reference.paged_attention(*batch.args())) <= 1e-5


def test_bench_record_and_plot_from_a_small_run(kernels, tmp_path):
    """The bench's plumbing at a small shape: each timed call runs once; the 'time' is fixed."""
    calls = []

    def run_once(fn) -> float:
        fn()
        calls.append(fn)
        return 0.5

    result = bench.measure(_small_bench_args(peak_gbps=100.0), DEVICE, "test device", run_once,
                           cases=CASES[-2:])
    assert result["all_correct"] and len(result["correctness"]) == 2
    # The default launch (warm-up, then timed), two SDPA baselines, the copy; on CUDA also the
    # default launch and SDPA replayed from CUDA graphs.
    assert len(calls) == 5 + (2 if ON_GPU else 0)
    assert result["copy_gbps"] == pytest.approx(2 * 2**20 / 0.5e-3 / 1e9)
    assert result["kv_bytes"] == 2 * 4 * 3 * 40 * 2 * 32
    assert result["triton_default_fraction"] == pytest.approx(result["kv_bytes"] / 0.5e-3 / 100e9)
    bench.write_plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert len(bench.launch_configs("standard")) == 1 + 3 * 3 * 3
    assert len(bench.launch_configs("none")) == 1


@pytest.mark.skipif(ON_GPU, reason="checks the message shown where there is no GPU")
def test_bench_without_cuda_says_so_in_one_line(capsys):
    from training.cli import main

    assert main(["bench", "attention"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no CUDA device" in err and "\n" not in err


def test_engine_greedy_tokens_match_between_triton_and_torch_backends(kernels, tiny_model_dir):
    from engine.llm import LLM
    from scheduler.request import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 6, 19, 45)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        # A small token budget: long prompts arrive in chunks next to the others' decodes.
        llm = LLM(str(tiny_model_dir), attention_backend=backend, device=DEVICE,
                  max_num_batched_tokens=32, max_model_len=128, num_gpu_blocks=32)
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [list(out.token_ids) for out in llm.generate(prompts, greedy)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 12 for t in tokens["triton"])


def test_kernels_compile_for_hopper_without_a_gpu():
    """Triton's real compiler (not the interpreter) accepts every kernel variant, down to SASS."""
    from engine.kernels import compile_check

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "engine.kernels.compile_check", "--arch", "90"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    num_splitting = sum(variant[5] > 1 for variant in compile_check.VARIANTS)
    assert len(lines) == 1 + len(compile_check.VARIANTS) + num_splitting, result.stdout
    # A whole number: "40 B spilled" contains "0 B spilled" too.
    assert all(re.search(r"(?<![0-9])0 B spilled", line) for line in lines), result.stdout
