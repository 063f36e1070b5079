"""draftwise's CPU kernels (kernels/*.cpp), compiled once per machine.

They make every op of the native decoder batch-invariant (a token's logits are bit-identical
however many tokens the forward holds) and run GGUF's quantized blocks as shipped. PyTorch
builds them with the machine's C++ compiler the first time a model loads (about 2 minutes on
2 cores: 116 s on an AMD EPYC Zen 3, 2026-11-28) and keeps the library under the draftwise
cache, keyed by torch version, sources and CPU, so every later load finds it in milliseconds. Without a compiler, draftwise warns once and falls
back to PyTorch's own ops on float32 weights: correct, slower, and greedy speculation then
matches plain decoding only as far as those ops round alike.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from draftwise.models import registry

KERNEL_DIR = Path(__file__).parent / "kernels"
SOURCES = ("linear.cpp", "int8_linear.cpp", "int16_linear.cpp", "bf16_linear.cpp", "amx_linear.cpp", "rowwise.cpp", "decoder.cpp", "module.cpp")
# DRAFTWISE_KERNEL=0 skips the kernels (PyTorch ops only): for comparisons and for machines where
# building is unwanted.
DISABLE_ENV = "DRAFTWISE_KERNEL"
# DRAFTWISE_MARCH=x86-64-v3 (any -march value) builds for that instruction set instead of this
# CPU's: a developer's way to run and time the AVX2 paths (what an AMD EPYC Zen 3 builds) on a CPU
# with AVX-512. Its own build; auto activations then follow what the build has (float32 there).
MARCH_ENV = "DRAFTWISE_MARCH"
# DRAFTWISE_KERNEL_OPT=-O1 builds with that optimisation level instead of -O3: the same values
# (-ffp-contract=off and no fast-math at every level, so each float operation is the one the
# source spells), slower code, a much shorter build. For tests of a build no one times: the
# portable build (DRAFTWISE_MARCH=x86-64-v2) of linear.cpp takes 177 s at -O3 and 31 s at -O1 on
# an AMD EPYC Zen 3. Its own build, like DRAFTWISE_MARCH's.
OPT_ENV = "DRAFTWISE_KERNEL_OPT"
# Every draftwise upgrade (new sources), torch version, compiler or checkout gets a build of its
# own (5-6 MB); a new build removes the others no process has loaded for this long.
STALE_AFTER_DAYS = 30
USED_MARKER = "last-used"


def native_kernels(progress: bool = True) -> ModuleType | None:
    """The compiled kernels module (blocked_linear, int8_linear, bf16_linear, dequantize_rows, rms_norm, silu_mul,
    rotary, attention, and Decoder: a model's layers in one call), or None (with one warning saying why) where it cannot be built.
    progress: say on stderr that a first build is under way."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if "kernel" not in _BUILT:  # one build (or one failure, one warning) per process
        module = _build(progress)
        if module is not None:
            _give_codebooks(module)
        _BUILT["kernel"] = module
    return _BUILT["kernel"]


_BUILT: dict[str, ModuleType | None] = {}


def loaded_kernels() -> ModuleType | None:
    """The kernels module if this process has already built or loaded it, else None: for ops
    that may use the kernels but must never start a build (the verifier on hand-made logits)."""
    return _BUILT.get("kernel")


def _build(progress: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    build_dir = _build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    _mark_used(build_dir)  # before loading: another process's clean-up never takes a build being loaded
    first_build = not any(build_dir.glob("*.so"))
    if progress and first_build:
        print(_build_notice(), file=sys.stderr, flush=True)
    try:
        module = load(
            name="draftwise_kernels",
            sources=[str(KERNEL_DIR / name) for name in SOURCES],
            build_directory=str(build_dir),
            # -fopenmp: ATen's parallel_for is a header template that runs on one thread unless
            # OpenMP is on (measured: 2x slower). _contraction_flags: why no compiler may fuse
            # products and sums by itself.
            extra_cflags=[*_optimisation_flags(), *_contraction_flags(), "-fopenmp", *_arch_flags()],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja shows up as several exception types
        warnings.warn(
            f"draftwise could not compile its CPU kernels ({_build_failure(error)}). Models will run on "
            "PyTorch's own ops over float32 weights (GGUF blocks dequantised at load): correct, but "
            "slower and 7x the memory for 4-bit files, and greedy speculation then equals plain "
            "decoding only as far as those ops round a k-token forward like k one-token ones (the "
            "tests check it; it is not guaranteed). Install a C++ compiler (g++) and `pip install "
            f"ninja` to get them, or set {DISABLE_ENV}=0 to skip them without this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    if first_build:
        _remove_stale_builds(build_dir)
    return module


# GGUF's lattice formats (IQ1/IQ2/IQ3 below 4 bits), whose codebooks the kernels read (kernels/lattice.h)
LATTICE_FORMATS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def _give_codebooks(module: ModuleType) -> None:
    """Hand gguf-py's codebooks of the lattice formats to the kernels (kernels/lattice.h): the
    tables a GGUF file's IQ blocks index, kept in one place (gguf.quants), not copied into C++."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    for name in LATTICE_FORMATS:
        codebook = getattr(quants, name)
        codebook.init_grid()  # built once per process from gguf-py's packed form
        grid = np.ascontiguousarray(codebook.grid.reshape(-1, codebook.grid_shape[1]), dtype=np.float32)
        module.set_lattice_grid(int(getattr(GGMLQuantizationType, name)), torch.from_numpy(grid))
    module.set_lattice_signs(torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8))


def _mark_used(build_dir: Path) -> None:
    """Stamp the build as loaded now (its marker's mtime), so that no other build's clean-up
    takes it while it is in use. A read-only cache keeps its builds."""
    try:
        (build_dir / USED_MARKER).touch()
    except OSError:
        pass


def _last_used(build_dir: Path) -> float:
    """When a build was last loaded: its marker's mtime, or, for builds older than the marker,
    the latest mtime of the folder and its libraries (a build under way is new by these too)."""
    paths = [build_dir, build_dir / USED_MARKER, *build_dir.glob("*.so")]
    return max((path.stat().st_mtime for path in paths if path.exists()), default=0.0)


def _remove_stale_builds(keep: Path) -> None:
    """Remove the other kernel builds beside `keep` that no process has loaded for
    STALE_AFTER_DAYS (called after a new build: the old ones are then usually an earlier
    draftwise's or torch's). Only folders named as builds are touched."""
    cutoff = time.time() - STALE_AFTER_DAYS * 86400
    for other in keep.parent.glob("draftwise_kernels-*"):
        if other != keep and other.is_dir() and _last_used(other) < cutoff:
            shutil.rmtree(other, ignore_errors=True)


def builds_portable_code() -> bool:
    """Whether this build gets the portable vector code (vec.h's GCC vectors, no AVX2 intrinsics):
    a CPU other than x86 or without AVX2, or DRAFTWISE_MARCH naming an instruction set below AVX2."""
    march = os.environ.get(MARCH_ENV)
    if march:
        return march in ("x86-64", "x86-64-v2")
    return platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _cpu_flags_line().split()


def _build_notice() -> str:
    """The first build's message: what it costs here. The portable code takes ~2x as long to
    compile and its products run ~6x slower than the AVX2 code's (AMX Xeon model 207, 2 cores,
    2026-11-28, DRAFTWISE_MARCH=x86-64-v2 against x86-64-v3: 2.5-2.9 against 1.1-1.4 minutes,
    GCC splitting every 64-byte vector into SSE pieces; SmolLM2's 1536 x 576 gate at one row 0.7 ms
    against 0.08-0.13, its LM head 8.5-9.9 ms against 1.5)."""
    if builds_portable_code():
        return ("draftwise: compiling its CPU kernels for this machine (once per checkout, about 3 minutes on 2 cores: "
                "without AVX2 they are the portable vector code, which also runs several times slower)...")
    return "draftwise: compiling its CPU kernels for this machine (once per checkout, about 2 minutes on 2 cores)..."


def _build_failure(error: Exception) -> str:
    """What went wrong, in a line: the compiler's first error (PyTorch's message opens with the
    whole compile command), with the fix where it is known."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    reason = next((line for line in lines if "error:" in line), lines[0])
    if "omp.h" in reason:  # clang without its OpenMP runtime's headers
        reason += "; the compiler has no OpenMP headers: install them (clang: libomp-dev) or set CXX=g++"
    return reason


@functools.cache
def _compiler() -> tuple[str, str]:
    """(name, version) of the C++ compiler PyTorch's builder uses, e.g. ("gcc", "12.2.0");
    ("", "") where it cannot be asked."""
    import subprocess

    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        compiler = get_cxx_compiler()
        banner = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        version = subprocess.run([compiler, "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "", ""
    return ("clang" if "clang" in banner.lower() else "gcc"), version.strip()


def _contraction_flags() -> list[str]:
    """-ffp-contract=off with every compiler: the kernels spell each fused multiply-add they mean
    (vec.h's fmadd), and no compiler fuses any other product and sum. The kernels' bit-equalities
    (a row the same bits alone, in a draft, a tree or a prefill) need every path that computes
    the same output to round alike; left to contract by itself, GCC 13.3 (Ubuntu 24.04) fused a
    Q4_0 product's decode path and not its dequantised path (an ulp apart on an Intel Xeon with
    AMX; an attention tree node 1.2e-7 from the same query alone; 12 tests of
    tests/test_kernels.py failed). GCC 12 happened to contract every path alike."""
    return ["-ffp-contract=off"]


OPTIMISATION_LEVELS = ("-O0", "-O1", "-O2", "-O3", "-Os")  # none of them reorders float operations


def _optimisation_flags() -> list[str]:
    return [_checked_level(os.environ.get(OPT_ENV) or "-O3")]


@functools.cache  # one warning per value, though a build asks twice (its directory's key, its flags)
def _checked_level(level: str) -> str:
    if level in OPTIMISATION_LEVELS:
        return level
    warnings.warn(
        f"{OPT_ENV}={level!r} is not one of {', '.join(OPTIMISATION_LEVELS)}: building the kernels at -O3. "
        "(-Ofast or -ffast-math would let the compiler reorder float sums, which a row's bits "
        "being the same in every forward forbids.)",
        RuntimeWarning,
        stacklevel=4,
    )
    return "-O3"


def _arch_flags() -> list[str]:
    # Built on the machine that runs it, so it may use every instruction this CPU has (or, with
    # DRAFTWISE_MARCH, those of the instruction set it names).
    if os.environ.get(MARCH_ENV):
        return [f"-march={os.environ[MARCH_ENV]}"]
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []


def _cpu_flags_line() -> str:
    """/proc/cpuinfo's first "flags" line ("" where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")


def has_vnni() -> bool:
    """Whether the int8 kernels get AVX-512 VNNI's one-instruction byte dot product (their only
    VNNI form: a CPU with AVX-VNNI but no AVX-512 builds the AVX2 one). Without it Q8_0 products
    on int8 activations take three byte multiply-adds per 32 bytes and are slower than on
    float32 activations. The build's answer where it is loaded (a DRAFTWISE_MARCH=x86-64-v3 build
    on a CPU with VNNI has the AVX2 code), else the CPU's flags."""
    kernels = loaded_kernels()
    if kernels is not None:
        return kernels.int8_dot_in_hardware()
    return "avx512_vnni" in _cpu_flags_line().split()


# The CPU's vector extensions that decide which kernel paths run (and how fast).
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def machine() -> dict:
    """What a measurement ran on, for reports: the CPU's name, family and model and its vector
    extensions that the kernels use (from /proc/cpuinfo), and the kernels this process loaded:
    their vector paths (avx512, avx2 or generic; none where they are off or unbuilt) and the
    instruction set asked for with DRAFTWISE_MARCH. Never starts a build."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else ():
        key, _, value = line.partition(":")
        if not line.strip():
            break  # the first processor is enough
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    kernels = loaded_kernels()
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "family_model": f"{fields['cpu family']}/{fields['model']}" if "cpu family" in fields and "model" in fields else None,
        "vector_flags": [flag for flag in _VECTOR_FLAGS if flag in flags],
        "kernels": kernels.vector_paths() if kernels is not None else None,
        "march": os.environ.get(MARCH_ENV) or None,
    }


def describe_machine(description: dict) -> str:
    """machine() in a line: "Intel(R) Xeon(R) Processor, family/model 6/207, avx2 fma avx512f ...,
    avx512 kernels"."""
    parts = [description["cpu"]]
    if description.get("family_model"):
        parts.append(f"family/model {description['family_model']}")
    if description.get("vector_flags"):
        parts.append(" ".join(description["vector_flags"]))
    kernels = description.get("kernels")
    march = f" (-march={description['march']})" if description.get("march") else ""
    parts.append(f"{kernels} kernels{march}" if kernels else "no native kernels")
    return ", ".join(parts)


def _build_directory() -> Path:
    """One build per torch version, kernel sources and CPU: a cache shared by machines of
    different CPUs must not hand one machine's -march=native library to another. And one per
    checkout (the sources' folder): PyTorch's builder writes the sources' paths into the build's
    ninja file, so two checkouts of the same sources sharing a build rebuilt it (90-185 s on
    2 cores) every time a process of the other one loaded it (seen 2026-11-27: a CI run in a
    clone beside /work/main rebuilt the kernels at least four times and took 34 minutes)."""
    cpu = platform.processor() or platform.machine()
    flags = _cpu_flags_line()
    if flags:
        cpu += flags
    sources = b"".join(path.read_bytes() for path in sorted(KERNEL_DIR.glob("*.[ch]*")))
    compiler = "|".join(_compiler()) + "|" + " ".join(_optimisation_flags() + _contraction_flags() + _arch_flags())  # another compiler, -O or -march: another build
    checkout = str(KERNEL_DIR.resolve())
    key = hashlib.sha256(f"{torch.__version__}|{cpu}|{compiler}|{checkout}".encode() + sources).hexdigest()[:12]
    return registry.cache_root() / "kernels" / f"draftwise_kernels-{key}"
