"""The engine on the Triton attention backend gives HF's greedy tokens.

On a machine without CUDA the kernels run under the Triton interpreter, which must be switched on
before the kernel module is first imported; a fresh interpreter process guarantees that whatever
other tests imported before. Shapes are tiny: the interpreter costs milliseconds per loop iteration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_reference import hf_greedy, random_prompts

ROOT = Path(__file__).resolve().parent.parent
NUM_TOKENS = 6

SCRIPT = """
import json, sys
from engine.llm import LLM
from scheduler.request import SamplingParams
import engine.kernels.paged_attention as paged
def no_sync(*args):  # the engine must pass host-side maxima, or every layer syncs to find them
    raise AssertionError("attention called without length hints")
paged._max_lengths = no_sync
model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model_dir, attention_backend="triton", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16,
          num_gpu_blocks=32, block_size=8, num_threads=1)
outputs = llm.generate(prompts, SamplingParams(max_tokens={num_tokens}, temperature=0.0, ignore_eos=True))
print(json.dumps({{"backend": llm.engine.runner.backend.name, "tokens": [list(o.token_ids) for o in outputs]}}))
"""


def test_triton_backend_gives_hf_tokens(tiny_model_dir):
    prompts = random_prompts([3, 11, 26], seed=2)
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(num_tokens=NUM_TOKENS), str(tiny_model_dir), json.dumps(prompts)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["backend"] == "triton"
    assert reply["tokens"] == hf_greedy(tiny_model_dir, prompts, NUM_TOKENS)
