"""The engine's host-allocator setting: a freed step-sized buffer stays in the process."""

import subprocess
import sys

import pytest

from engine.host_memory import retain_freed_host_memory

# In a fresh interpreter: malloc, touch and free a 24 MB block (a decode group's K gather is about
# that size), then print how many more free bytes the heap holds. glibc's defaults serve such a
# block with mmap and unmap it on free (0 kept); with the engine's setting it stays for reuse.
PROBE = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "retain":
    from engine.host_memory import retain_freed_host_memory
    assert retain_freed_host_memory()
size = 24 * 1024 * 1024
before = libc.mallinfo2().fordblks
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print(libc.mallinfo2().fordblks - before)
"""

BLOCK_BYTES = 24 * 1024 * 1024


def kept_bytes(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def test_a_freed_step_sized_block_stays_in_the_heap_only_when_retained():
    if not retain_freed_host_memory():
        pytest.skip("no glibc mallopt on this platform")
    try:
        default = kept_bytes("default")
    except subprocess.CalledProcessError as error:
        pytest.skip(f"no mallinfo2 (glibc < 2.33): {error.stderr.strip().splitlines()[-1]}")
    assert default < BLOCK_BYTES, default
    assert kept_bytes("retain") >= BLOCK_BYTES
