"""The engine's host-allocator setting: freed step buffers are reused, not faulted in again."""

import subprocess
import sys

import pytest

from engine.host_memory import retain_freed_host_memory

# Decode-like steps in a fresh interpreter: per layer, K and V gathers into new buffers that grow
# with the context each step. Prints minor page faults per step.
PROBE = """
import resource, sys, torch
if sys.argv[1] == "retain":
    from engine.host_memory import retain_freed_host_memory
    assert retain_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step(i):
    for layer in range(4):
        k = torch.ones((16 + i) * 256 * 1024)
        v = torch.ones((16 + i) * 256 * 1024)
step(0)
before = faults()
for i in range(1, 13):
    step(i)
print((faults() - before) / 12)
"""


def faults_per_step(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def test_retaining_freed_memory_avoids_refaulting_step_buffers():
    if not retain_freed_host_memory():
        pytest.skip("no glibc mallopt on this platform")
    default, retained = faults_per_step("default"), faults_per_step("retain")
    # Each step touches ~36 MB of fresh buffers: ~9k pages when glibc hands them back, only the
    # growth of the heap when it keeps them.
    assert retained < default / 4, (default, retained)
