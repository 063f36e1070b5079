"""draftwise.models.memory: a forward's big tensors come from glibc's heap, where freed pages are
reused, instead of fresh mappings that fault every page in again (Qwen2.5-Coder-1.5B, a 512-token
prefill: ~505,000 minor page faults a forward without the settings, 0 with them). Checked in
fresh processes (the settings are per process) through glibc's own accounting (mallinfo2: bytes
in mmapped chunks), with the opt-out as the control."""

from __future__ import annotations

import os
import subprocess
import sys

# One 18 MB tensor (a Qwen2.5-1.5B 512-token prefill's gate projection): how many bytes of it
# glibc serves from a fresh mapping rather than its heap.
SCRIPT = """
import ctypes, torch
from draftwise.models.memory import keep_freed_memory
applied = keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
tensor = torch.ones(18 * 1024 * 1024 // 4)
print(applied, libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(setting: str) -> tuple[bool, int]:
    env = {**os.environ, "DRAFTWISE_KEEP_FREED_MEMORY": setting}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    applied, mapped = out.stdout.split()
    return applied == "True", int(mapped)


def test_big_tensors_come_from_the_heap_where_freed_pages_are_reused():
    applied, mapped = _mapped_bytes("1")
    assert applied and mapped == 0, f"{mapped} bytes of an 18 MB tensor were freshly mapped"
    applied, mapped = _mapped_bytes("0")  # the control: glibc's default maps it anew
    assert not applied and mapped >= 18 * 1024 * 1024


def test_a_new_kv_cache_takes_memory_only_as_it_fills():
    # KVCache is not zeroed: a request's capacity (prompt + max_tokens) costs resident memory only
    # for the slots it writes. Zeroed, this cache would add its whole ~940 MB at once.
    import torch

    from draftwise.kv_cache import KVCache

    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    cache = KVCache(28, 2, 128, 32768, dtype=torch.bfloat16)  # Qwen2.5-1.5B's shape, 32k slots
    cache.keys[:, :, :, :1000] = 1.0
    cache.values[:, :, :, :1000] = 1.0
    grown = resident_bytes() - before
    assert grown < 150 * 2**20, f"a 1,000-token fill of a 32k-slot cache added {grown / 2**20:.0f} MB"
