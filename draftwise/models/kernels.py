"""draftwise's CPU kernels (kernels/*.cpp), compiled once per machine.

They make every op of the native decoder batch-invariant (a token's logits are bit-identical
however many tokens the forward holds) and run GGUF's quantized blocks as shipped. PyTorch
builds them with the machine's C++ compiler the first time a model loads (about 30 s here, on 2 cores)
and keeps the library under the draftwise cache, keyed by torch version, sources and CPU, so
every later load finds it in milliseconds. Without a compiler, draftwise warns once and falls
back to PyTorch's own ops on float32 weights: correct, slower, and greedy speculation then
matches plain decoding only as far as those ops round alike.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from draftwise.models import registry

KERNEL_DIR = Path(__file__).parent / "kernels"
SOURCES = ("linear.cpp", "int8_linear.cpp", "bf16_linear.cpp", "amx_linear.cpp", "rowwise.cpp", "decoder.cpp", "module.cpp")
# DRAFTWISE_KERNEL=0 skips the kernels (PyTorch ops only): for comparisons and for machines where
# building is unwanted.
DISABLE_ENV = "DRAFTWISE_KERNEL"



def native_kernels(progress: bool = True) -> ModuleType | None:
    """The compiled kernels module (blocked_linear, int8_linear, bf16_linear, dequantize_rows, rms_norm, silu_mul,
    rotary, attention, and Decoder: a model's layers in one call), or None (with one warning saying why) where it cannot be built.
    progress: say on stderr that a first build is under way."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if "kernel" not in _BUILT:  # one build (or one failure, one warning) per process
        _BUILT["kernel"] = _build(progress)
    return _BUILT["kernel"]


_BUILT: dict[str, ModuleType | None] = {}


def _build(progress: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    build_dir = _build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    if progress and not any(build_dir.glob("*.so")):
        print("draftwise: compiling its CPU kernels for this machine (once, about 30 s)...",
              file=sys.stderr, flush=True)
    try:
        module = load(
            name="draftwise_kernels",
            sources=[str(KERNEL_DIR / name) for name in SOURCES],
            build_directory=str(build_dir),
            # -ffp-contract=fast: fused multiply-adds (ISO C++ mode turns them off; without
            # them the kernel is 2x the instructions). -fopenmp: ATen's parallel_for is a
            # header template that runs on one thread unless OpenMP is on (measured: 2x slower).
            extra_cflags=["-O3", "-ffp-contract=fast", "-fopenmp", *_arch_flags()],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja shows up as several exception types
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"draftwise could not compile its CPU kernels ({first_line}). Models will run on "
            "PyTorch's own ops over float32 weights (GGUF blocks dequantised at load): correct, but "
            "slower and 7x the memory for 4-bit files, and greedy speculation then equals plain "
            "decoding only as far as those ops round a k-token forward like k one-token ones (the "
            "tests check it; it is not guaranteed). Install a C++ compiler (g++) and `pip install "
            f"ninja` to get them, or set {DISABLE_ENV}=0 to skip them without this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return module


def _arch_flags() -> list[str]:
    # Built on the machine that runs it, so it may use every instruction this CPU has.
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []


def _build_directory() -> Path:
    """One build per torch version, kernel sources and CPU: a cache shared by machines of
    different CPUs must not hand one machine's -march=native library to another."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
        cpu += flags
    sources = b"".join(path.read_bytes() for path in sorted(KERNEL_DIR.glob("*.[ch]*")))
    key = hashlib.sha256(f"{torch.__version__}|{cpu}".encode() + sources).hexdigest()[:12]
    return registry.cache_root() / "kernels" / f"draftwise_kernels-{key}"
