"""Compile the kernels ahead of time for an NVIDIA target, no GPU needed.

`python -m engine.kernels.compile_check [--arch 90]` runs Triton's full compile pipeline (down
to PTX and, through the ptxas bundled with Triton, SASS) for the launch shapes the engine and the
bench use, and prints shared memory, registers and spills per variant. It catches what the CPU
interpreter cannot: errors that only the compiler raises (constexpr misuse, dot shape limits).
Must run without TRITON_INTERPRET (the kernels have to be defined as compiled functions).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TL_TYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
STRIDES = ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_k_blk",
           "stride_k_tok", "stride_k_head", "stride_v_blk", "stride_v_tok", "stride_v_head",
           "stride_bt_seq")
# (cache dtype, head_dim, group, BLOCK_Q, BLOCK_N, NUM_SPLITS, num_warps): decode as in the bench,
# a prefill tile, split-KV, and the tiny test model's shape.
VARIANTS = (
    ("bf16", 128, 4, 4, 64, 1, 4),
    ("bf16", 128, 4, 4, 64, 2, 4),
    ("bf16", 128, 4, 16, 64, 1, 8),
    ("fp16", 64, 3, 4, 128, 1, 8),
    ("fp32", 64, 3, 16, 32, 1, 8),
    ("fp32", 64, 3, 4, 64, 1, 4),
)


def _source(kernel, signature: dict[str, str], constants: dict[str, object]) -> ASTSource:
    signature = {**signature, **{name: "constexpr" for name in constants}}
    names = list(signature)
    # Pointers and strides are 16-byte aligned in practice; Triton specialises on that at launch.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name.startswith("stride")}
    return ASTSource(kernel, signature, attrs=aligned,
                     constexprs={(names.index(k),): v for k, v in constants.items()})


def _attention_sources(dtype: str, head_dim: int, group: int, block_q: int, block_n: int,
                       splits: int) -> list[tuple[str, ASTSource]]:
    from engine.kernels.paged_attention import _merge_splits_kernel, _paged_attention_kernel

    ptr = f"*{dtype}"
    signature = {"out_ptr": ptr, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "q_ptr": ptr,
                 "k_cache_ptr": ptr, "v_cache_ptr": ptr, "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "qk_scale": "fp32",
                 **{name: "i32" for name in STRIDES}}
    constants = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim, "GROUP": group,
                 "GROUP_PAD": triton.next_power_of_2(group), "BLOCK_Q": block_q,
                 "BLOCK_N": block_n, "BLOCK_SIZE": 16, "NUM_SPLITS": splits,
                 "DOT_DTYPE": TL_TYPES[dtype]}
    sources = [("paged_attention", _source(_paged_attention_kernel, signature, constants))]
    if splits > 1:
        merge_signature = {"out_ptr": ptr, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                           "stride_o_tok": "i32", "stride_o_head": "i32"}
        merge_constants = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim, "NUM_SPLITS": splits}
        sources.append(("merge_splits", _source(_merge_splits_kernel, merge_signature,
                                                merge_constants)))
    return sources


def _write_kv_source(dtype: str) -> ASTSource:
    from engine.kernels.write_kv import _write_kv_kernel

    ptr = f"*{dtype}"
    signature = {"k_ptr": ptr, "v_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
                 "slot_mapping_ptr": "*i64", "num_tokens": "i32",
                 **{f"stride_{name}": "i32" for name in (
                     "k_tok", "k_head", "v_tok", "v_head", "kc_blk", "kc_tok", "kc_head",
                     "vc_blk", "vc_tok", "vc_head")}}
    constants = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "KV_HEADS_PAD": 8,
                 "BLOCK_SIZE": 16, "BLOCK_T": 2}
    return _source(_write_kv_kernel, signature, constants)


def _ptxas_report(ptx: str, arch: int) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as handle:
        handle.write(ptx)
        handle.flush()
        result = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", handle.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} B spilled"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    jobs = [("write_kv bf16 d128 h8", _write_kv_source("bf16"), 4)]
    for dtype, head_dim, group, block_q, block_n, splits, warps in VARIANTS:
        for name, source in _attention_sources(dtype, head_dim, group, block_q, block_n, splits):
            label = f"{name} {dtype} d{head_dim} g{group} q{block_q} n{block_n} s{splits} w{warps}"
            jobs.append((label, source, warps))
    for label, source, warps in jobs:
        kernel = triton.compile(source, target=target, options={"num_warps": warps, "num_stages": 2})
        print(f"{label}: {kernel.metadata.shared} B shared, "
              f"{_ptxas_report(kernel.asm['ptx'], args.arch)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
