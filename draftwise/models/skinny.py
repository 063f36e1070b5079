"""The float32 decode kernel (kernels/skinny_linear.cpp), compiled once per machine.

PyTorch builds it with the machine's C++ compiler the first time a float32 model loads
(about 25 s here) and keeps the library under the draftwise cache, keyed by torch version
and CPU, so every later load finds it in milliseconds. Without a compiler, draftwise warns
once and falls back to MKL's kernels: the same output, slower drafts.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from draftwise.models import registry

SOURCE = Path(__file__).parent / "kernels" / "skinny_linear.cpp"
# DRAFTWISE_KERNEL=0 skips the kernel (MKL only): for comparisons and for machines where
# building is unwanted.
DISABLE_ENV = "DRAFTWISE_KERNEL"

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], weight [N, K]) -> [M, N]


def skinny_kernel(progress: bool = True) -> Kernel | None:
    """The compiled kernel, or None (with one warning saying why) where it cannot be built.
    progress: say on stderr that a first build is under way."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if "kernel" not in _BUILT:  # one build (or one failure, one warning) per process
        _BUILT["kernel"] = _build(progress)
    return _BUILT["kernel"]


_BUILT: dict[str, Kernel | None] = {}


def _build(progress: bool) -> Kernel | None:
    from torch.utils.cpp_extension import load

    build_dir = _build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    if progress and not any(build_dir.glob("*.so")):
        print("draftwise: compiling the float32 decode kernel for this CPU (once, about 25 s)...",
              file=sys.stderr, flush=True)
    try:
        module = load(
            name="draftwise_skinny_linear",
            sources=[str(SOURCE)],
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
            f"draftwise could not compile its float32 decode kernel ({first_line}). float32 models "
            "will use MKL's kernels: the same output, but verifying a draft costs up to 2x a plain "
            f"step instead of 1.07-1.5x. Install a C++ compiler (g++) and `pip install ninja` to get it, "
            f"or set {DISABLE_ENV}=0 to skip it without this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return module.skinny_linear


def _arch_flags() -> list[str]:
    # Built on the machine that runs it, so it may use every instruction this CPU has.
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []


def _build_directory() -> Path:
    """One build per torch version and CPU: a cache shared by machines of different CPUs
    must not hand one machine's -march=native library to another."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
        cpu += flags
    key = hashlib.sha256(f"{torch.__version__}|{cpu}".encode()).hexdigest()[:12]
    return registry.cache_root() / "kernels" / f"skinny_linear-{key}"
