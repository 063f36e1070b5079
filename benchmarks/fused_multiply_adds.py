"""Finds multiply-adds in the kernels that the source does not spell as fused (vec.h's fmadd).

The kernels build with -ffp-contract=off, so only the fused multiply-adds the source writes are
fused, and every path computing the same output rounds alike whatever the compiler
(draftwise/models/kernels.py, _contraction_flags). A product added to something without fmadd
is then two roundings where one was meant, and costs an instruction. This builds every kernel
source twice for one -march, with contraction off and with it on (-ffp-contract=fast: the
compiler fuses what it can), counts the fused multiply-add instructions of each function in the
object files (objdump), and lists the functions whose counts differ: there a product and a sum
are left for the compiler to fuse. Exit status 1 if any.

    python benchmarks/fused_multiply_adds.py                       # this CPU (-march=native)
    python benchmarks/fused_multiply_adds.py --march cooperlake    # AVX-512 with BF16 and VNNI
    python benchmarks/fused_multiply_adds.py --march sapphirerapids --cxx clang++-14

Needs the compiler and binutils' objdump; about 2 minutes a build on 2 cores."""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils.cpp_extension import include_paths

KERNEL_DIR = Path(__file__).resolve().parent.parent / "draftwise" / "models" / "kernels"
FUSED = re.compile(r"\bv?f(n)?m(add|sub)(132|213|231)?[ps]s\b")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def compile_source(cxx: str, source: Path, out: Path, march: str, contraction: str) -> None:
    includes = [flag for path in [*include_paths(), sysconfig.get_paths()["include"]] for flag in ("-isystem", path)]
    command = [cxx, *includes, "-fPIC", "-std=c++20", "-O3", f"-ffp-contract={contraction}", "-fopenmp",
               f"-march={march}", "-w", "-Wno-psabi", "-c", str(source), "-o", str(out)]
    subprocess.run(command, check=True)


def fused_per_function(objfile: Path) -> collections.Counter:
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(objfile)], check=True,
                             capture_output=True, text=True).stdout
    counts: collections.Counter = collections.Counter()
    function = ""
    for line in listing.splitlines():
        header = FUNCTION.match(line)
        if header:
            function = header.group(1)
        elif FUSED.search(line):
            counts[function] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", default="native", help="the CPU to build for (any -march the compiler knows)")
    parser.add_argument("--cxx", default="c++")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    sources = sorted(path for path in KERNEL_DIR.glob("*.cpp") if path.name != "module.cpp")
    with tempfile.TemporaryDirectory() as scratch:
        jobs = [(source, Path(scratch) / f"{source.stem}.{contraction}.o", contraction)
                for source in sources for contraction in ("off", "fast")]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: compile_source(args.cxx, job[0], job[1], args.march, job[2]), jobs))
        differences = 0
        for source in sources:
            spelled = fused_per_function(Path(scratch) / f"{source.stem}.off.o")
            contracted = fused_per_function(Path(scratch) / f"{source.stem}.fast.o")
            print(f"{source.name}: {sum(spelled.values())} fused multiply-adds as written, "
                  f"{sum(contracted.values())} with contraction on")
            for function in sorted(set(spelled) | set(contracted)):
                if spelled[function] != contracted[function]:
                    differences += 1
                    print(f"  {spelled[function]} -> {contracted[function]}: {function[:160]}")
    if differences:
        print(f"{differences} functions have products and sums the source leaves unfused (or inlined differently:"
              " compare the totals); spell them with fmadd.")
        return 1
    print("every fused multiply-add is in the source")
    return 0


if __name__ == "__main__":
    sys.exit(main())
