"""`lengthwise bench attention`: the Triton paged attention kernel on a CUDA device.

1. Correctness: every case of engine/kernels/cases.py on the device, against the torch reference.
2. Decode bandwidth: batch x context decode queries (default 64 x 2048, 32 query / 8 KV heads,
   head_dim 128, bf16) over a paged cache with shuffled blocks. Achieved bandwidth = bytes of K/V
   read / kernel time, reported as a fraction of the device's peak HBM bandwidth (table below,
   or --peak-gbps). A small sweep of launch configurations shows what the default leaves.
3. Baseline: torch scaled_dot_product_attention over the same K/V gathered into contiguous
   [batch, kv_heads, context, head_dim] tensors (the gather is not timed), with enable_gqa; and,
   for reference, over K/V expanded to every query head.
4. Usable ceiling: a plain device-to-device copy (--copy-mib); the kernel's bandwidth is also
   given as a fraction of what that copy reaches.
5. The default launch and SDPA once more, each replayed from a CUDA graph: their time without the
   host's launch cost, which dominates at small batches.
Writes bench_attention.json and bench_attention.png under --out. Times are medians of
triton.testing.do_bench, which flushes L2 between runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from engine.arg_types import positive_float, positive_int, power_of_two, prepare_output_dir
from engine.config import REPO_ROOT

# Peak HBM bandwidth in GB/s by device-name substring; the first match wins (specific first).
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40", 864.0),  # L40 and L40S
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Launch sweeps (block_n, num_splits, (num_warps, num_stages)); "wide" explores for tuning.
SWEEPS = {
    "none": ((), (), ()),
    "standard": ((32, 64, 128), (1, 2, 4), ((4, 2), (4, 3), (8, 2))),
    "wide": ((32, 64, 128, 256), (1, 2, 4, 8), ((4, 2), (4, 3), (8, 2), (8, 4))),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--context", type=positive_int, default=2048)
    parser.add_argument("--num-heads", type=positive_int, default=32)
    parser.add_argument("--num-kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--block-size", type=power_of_two, default=16)  # tl.arange needs a power of two
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--peak-gbps", type=positive_float, default=None,
                        help="peak memory bandwidth in GB/s (default: looked up by device name)")
    parser.add_argument("--copy-mib", type=positive_int, default=1024,
                        help="size of the device-to-device copy that measures usable bandwidth")
    parser.add_argument("--sweep", choices=list(SWEEPS), default="standard",
                        help="launch configurations timed besides the default")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "bench_attention")


def peak_gbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((gbps for key, gbps in PEAK_GBPS if key in device_name), None)


def check_correctness(device: str, cases=None) -> list[dict]:
    from engine.attention import reference
    from engine.kernels.cases import CASES, TOLERANCE, make_batch
    from engine.kernels.paged_attention import triton_paged_attention

    results = []
    for case in CASES if cases is None else cases:
        batch = make_batch(case, device)
        out = triton_paged_attention(*batch.args())
        error = (out.float() - reference.paged_attention(*batch.args()).float()).abs().max().item()
        results.append({"case": case.name, "max_abs_error": error,
                        "tolerance": TOLERANCE[case.dtype], "ok": error <= TOLERANCE[case.dtype]})
    return results


def decode_batch(args: argparse.Namespace, device: str):
    """Every sequence decodes one token at `context` length; blocks are shuffled over the cache."""
    from engine.kernels.cases import AttentionBatch

    dtype = DTYPES[args.dtype]
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = block_tables.view(args.batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(args.batch, args.num_heads, args.head_dim, generator=gen, device=device,
                    dtype=dtype)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(args.batch + 1, dtype=torch.int32, device=device)
    return AttentionBatch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          args.head_dim ** -0.5)


def gather_contiguous(batch, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of each sequence as dense [batch, kv_heads, context, head_dim] tensors."""
    _, block_size, kv_heads, head_dim = batch.k_cache.shape
    blocks = batch.block_tables.long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        dense = cache[blocks].reshape(blocks.shape[0], -1, kv_heads, head_dim)[:, :context]
        return dense.transpose(1, 2).contiguous()

    return gather(batch.k_cache), gather(batch.v_cache)


def time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def launch_configs(sweep: str) -> list:
    from engine.kernels.launch import LaunchConfig

    block_ns, splits, warps_stages = SWEEPS[sweep]
    configs = [LaunchConfig()]  # the default: splits and warps chosen per call
    configs += [LaunchConfig(block_n=n, num_splits=s, num_warps=w, num_stages=st)
                for n, s, (w, st) in itertools.product(block_ns, splits, warps_stages)]
    return configs


def decode_call(batch, context: int, config=None):
    """The decode attention call, with host-side lengths as the engine passes them: no device
    sync inside the timing. `config` None: the default launch."""
    from engine.kernels.paged_attention import triton_paged_attention

    return lambda: triton_paged_attention(*batch.args(), launch=config, max_query_len=1,
                                          max_seq_len=context)


def time_launches(batch, context: int, configs: list, timer) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    # On an H200 the first launch timed in a process read 1.3-1.7x the same launch timed later,
    # so one untimed pass of the default launch goes first. That did not always suffice (1.17x
    # once after it): the CUDA-graph replays timed in `measure` are the steadier figure.
    timer(decode_call(batch, context, configs[0]))
    rows = []
    for index, config in enumerate(configs):
        try:
            rows.append({"launch": asdict(config), "ms": timer(decode_call(batch, context, config))})
        except OutOfResources as error:  # a swept tile too big for shared memory; not the default
            if index == 0:
                raise
            rows.append({"launch": asdict(config), "ms": None, "error": str(error)})
    return rows


def cuda_graph_replay(fn):
    """`fn` captured once in a CUDA graph; returns its replay. Replays skip the Python wrapper and
    the launch cost, so timing them shows the kernels' own time (what an engine that captures its
    decode steps in graphs, as vLLM does, would see)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graphed_times(batch, context: int, k: torch.Tensor, v: torch.Tensor, timer) -> dict:
    """Default launch and SDPA, each replayed from a CUDA graph (CUDA only)."""
    triton_ms = timer(cuda_graph_replay(decode_call(batch, context)))
    sdpa_ms = timer(cuda_graph_replay(lambda: sdpa_decode(batch, k, v)))
    return {"triton_default_graph_ms": triton_ms, "sdpa_graph_ms": sdpa_ms}


def copy_gbps(device: str, mib: int, timer) -> float:
    """Bandwidth a plain device-to-device copy reaches (bytes read + written / time): the ceiling
    a streaming kernel can hope for on this device, next to the datasheet's peak."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def sdpa_decode(batch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The baseline: SDPA over contiguous K/V, query heads grouped onto KV heads by SDPA itself."""
    import torch.nn.functional as F

    q = batch.q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    return F.scaled_dot_product_attention(q, k, v, scale=batch.scale, enable_gqa=True).squeeze(2)


def measure(args: argparse.Namespace, device: str, device_name: str, timer, cases=None) -> dict:
    """Correctness cases (default: all), the decode sweep and the SDPA baseline, as one record."""
    from engine.kernels.paged_attention import triton_paged_attention

    correctness = check_correctness(device, cases)
    batch = decode_batch(args, device)
    kv_bytes = (2 * batch.k_cache.element_size() * args.batch * args.context
                * args.num_kv_heads * args.head_dim)
    peak = peak_gbps(device_name, args.peak_gbps)
    sweep = time_launches(batch, args.context, launch_configs(args.sweep), timer)
    for row in sweep:
        row["gbps"] = kv_bytes / row["ms"] / 1e6 if row["ms"] else None
        row["fraction_of_peak"] = row["gbps"] / peak if peak and row["gbps"] else None
    k, v = gather_contiguous(batch, args.context)
    sdpa_ms = timer(lambda: sdpa_decode(batch, k, v))
    # If SDPA's kernels lack native GQA it may fall back to math; K/V expanded to every query
    # head (4x the bytes) shows what its fused kernels do instead.
    group = args.num_heads // args.num_kv_heads
    k_wide, v_wide = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sdpa_expanded_ms = timer(lambda: sdpa_decode(batch, k_wide, v_wide))
    del k_wide, v_wide
    graphed = graphed_times(batch, args.context, k, v, timer) if device == "cuda" else {}
    # The timed kernel must compute what the baseline computes, at the benchmark's own shape.
    bench_error = (triton_paged_attention(*batch.args()).float()
                   - sdpa_decode(batch, k, v).float()).abs().max().item()
    best = min((row for row in sweep if row["ms"]), key=lambda row: row["ms"])
    copy = copy_gbps(device, args.copy_mib, timer)
    return {
        "device": device_name, "peak_gbps": peak, "kv_bytes": kv_bytes,
        "shape": f"decode {args.batch}x{args.context}, {args.num_heads}/{args.num_kv_heads} heads, "
                 f"d{args.head_dim}, bs{args.block_size}, {args.dtype}",
        "correctness": correctness, "bench_shape_max_abs_error_vs_sdpa": bench_error,
        "all_correct": all(c["ok"] for c in correctness) and bench_error <= 2e-2,
        "triton_default_ms": sweep[0]["ms"], "triton_default_gbps": sweep[0]["gbps"],
        "triton_default_fraction": sweep[0]["fraction_of_peak"],
        "triton_best_ms": best["ms"], "triton_best_launch": best["launch"],
        "triton_best_fraction": best["fraction_of_peak"],
        "copy_gbps": copy, "triton_default_fraction_of_copy": sweep[0]["gbps"] / copy,
        "triton_best_fraction_of_copy": best["gbps"] / copy,
        "sdpa_ms": sdpa_ms, "sdpa_gbps": kv_bytes / sdpa_ms / 1e6,
        "sdpa_expanded_kv_ms": sdpa_expanded_ms, **graphed, "sweep": sweep,
    }


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, max(4.0, 0.12 * len(result["sweep"]))))
    left.bar(["Triton paged\n(default)", "Triton paged\n(best)", "SDPA\n(contiguous)",
              "SDPA (K/V\nper q head)"],
             [result["triton_default_ms"], result["triton_best_ms"], result["sdpa_ms"],
              result["sdpa_expanded_kv_ms"]],
             color=["tab:blue", "tab:cyan", "tab:gray", "lightgray"])
    left.set_ylabel("decode attention time (ms)")
    left.set_title(result["shape"])
    labels = ["default (auto splits/warps)"] + [
        f"n{r['launch']['block_n']} s{r['launch']['num_splits']} w{r['launch']['num_warps']} "
        f"st{r['launch']['num_stages']}" for r in result["sweep"][1:]]
    right.barh(labels, [r["fraction_of_peak"] or 0.0 for r in result["sweep"]], color="tab:blue")
    right.axvline(0.7, color="tab:red", linestyle="--", label="70% goal")
    right.set_xlabel(f"fraction of peak bandwidth ({result['peak_gbps']} GB/s)")
    right.tick_params(axis="y", labelsize=6)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("lengthwise bench attention: no CUDA device here; run it on a GPU machine "
              "(scripts/gpu_check.sh)", file=sys.stderr)
        return 1
    if args.num_heads % args.num_kv_heads:
        raise ValueError(f"--num-heads {args.num_heads}: not a multiple of --num-kv-heads {args.num_kv_heads}")
    prepare_output_dir(args.out, "--out")  # before the measurements, not after them
    result = measure(args, "cuda", torch.cuda.get_device_name(), time_ms)
    (args.out / "bench_attention.json").write_text(json.dumps(result, indent=2))
    write_plot(result, args.out / "bench_attention.png")
    fraction, peak = result["triton_default_fraction"], result["peak_gbps"]
    print(f"{result['device']}: correctness {'ok' if result['all_correct'] else 'FAILED'}; "
          f"{result['shape']}: Triton {result['triton_default_ms']:.3f} ms = "
          f"{result['triton_default_gbps']:.0f} GB/s"
          + (f" ({fraction:.0%} of {peak:.0f})" if fraction else "")
          + f", {result['triton_default_fraction_of_copy']:.0%} of a copy's "
          f"{result['copy_gbps']:.0f} GB/s; best {result['triton_best_ms']:.3f} ms; "
          f"SDPA {result['sdpa_ms']:.3f} ms; from CUDA graphs: Triton "
          f"{result['triton_default_graph_ms']:.3f} ms, SDPA {result['sdpa_graph_ms']:.3f} ms; "
          f"wrote {args.out}")
    return 0 if result["all_correct"] else 2
