"""The kernels built for the instruction set below this CPU's, tested on this CPU.

The kernels compile different vector code per instruction set (vec.h): AVX-512, AVX2 (pairs of
256-bit vectors, what an AMD EPYC Zen 3 builds) or generic. CI's machines have AVX-512 (Intel
Xeons with AMX, AMD EPYC Zen 4), so without this file the AVX2 paths would run their tests only
on a developer's Zen 3, and a change that broke them would land. Here a child process builds the
kernels with DRAFTWISE_MARCH (a build of its own, cached beside the native one: ~1 minute on
2 cores the first time) and runs the kernels' bit-equality tests and the forward-invariance
property on real SmolLM2 weights in every format through it. On a CPU without AVX-512 the AVX2
paths are the native ones, and the generic paths (any other CPU) are the ones tested here: the
kernels' own bit-equalities only. The generic build alone takes ~3 minutes on 2 cores (GCC splits
every 64-byte vector into SSE pieces: linear.cpp 150-170 s, bf16_linear.cpp 138 s, against 21-39
and 30-43 s for the AVX2 build; AMX Xeon model 207, DRAFTWISE_MARCH=x86-64-v2), and the whole-forward
property over its slow products another ~100 s (7 formats; test_kernels.py itself 4 s), which an
AVX2-only CI machine (AMD EPYC Zen 3, ~1.3x this Xeon's suite time) cannot spare inside 20 minutes.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from draftwise.models import kernels as kernels_module

ROOT = Path(__file__).resolve().parent.parent
# What runs through the other build: every kernel test, and (through the AVX2 build, what a Zen 3
# runs) the property that a position's logits do not depend on what else its forward holds
# (chain, tree, prefill), in every format.
KERNEL_TESTS = ["tests/test_kernels.py"]
FORWARD_PROPERTY = "tests/test_batch_invariance.py::test_logits_do_not_depend_on_what_else_the_forward_holds"


def what_runs_through(paths: str) -> list[str]:
    return KERNEL_TESTS + ([FORWARD_PROPERTY] if paths == "avx2" else [])


def lower_instruction_set() -> tuple[str, str]:
    """(-march value, the vector paths its build compiles) one level below this CPU's."""
    flags = kernels_module._cpu_flags_line().split()
    if "avx512f" in flags:
        return "x86-64-v3", "avx2"
    return "x86-64-v2", "generic"


def build_settings(march: str) -> dict[str, str]:
    """DRAFTWISE_MARCH, and for the portable build -O1 (DRAFTWISE_KERNEL_OPT): the same float
    operations in the same order (no fast-math, -ffp-contract=off at every level), built in 70 s
    instead of 180 on an AMD EPYC Zen 3, where this build would otherwise hold one of CI's two
    cores for three minutes. The AVX2 build keeps -O3: it is the code a Zen 3 runs."""
    settings = {kernels_module.MARCH_ENV: march}
    if march == "x86-64-v2":
        settings[kernels_module.OPT_ENV] = "-O1"
    return settings


def run_with_march(march: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    # The child inherits PYTEST_XDIST_WORKER_COUNT, so conftest gives it this worker's share of the cores.
    environment = dict(os.environ, **build_settings(march))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction sets here are x86's")
def test_the_kernels_keep_their_bit_equalities_built_for_the_instruction_set_below_this_cpus():
    march, paths = lower_instruction_set()
    # The build really compiled that vector code (and not this CPU's: DRAFTWISE_MARCH was heard).
    built = run_with_march(march, "-c", "from draftwise.models.kernels import native_kernels; "
                           "print(native_kernels(progress=False).vector_paths())", timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split()[-1] == paths, (built.stdout, built.stderr[-3000:])
    result = run_with_march(march, "-m", "pytest", "-q", "-p", "no:cacheprovider", *what_runs_through(paths), timeout=1500)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"built with -march={march} ({paths} paths):\n{result.stdout[-6000:]}"
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
