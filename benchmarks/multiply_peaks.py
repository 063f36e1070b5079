"""This CPU's multiply-add peaks in 256-bit registers: the ceiling every AVX2 product works under.

Times register-only loops of independent chains (no memory traffic), one per instruction mix
the kernels use on AVX2, on 1 thread and on --threads threads (the best of 5 rounds each: on a
shared machine run it twice and keep the higher):

- float32: `vfmadd231ps` (8 multiply-adds an instruction), 12 chains: the float32 and bf16 paths;
- int8: `vpmaddubsw` + `vpmaddwd` + `vpaddd` (32 byte products an instruction pair), 6 chains:
  the int8 activations' products, and llama.cpp's on AVX2;
- int16: `vpmaddwd` + `vpaddd` (16 products an instruction), 6 chains.

A forward of T tokens through a model of P multiply-adds a token cannot take less than T * P /
peak: the bound behind docs/targets.md's "What the open rows would take".

    python benchmarks/multiply_peaks.py              # prints GMAC/s per mix, 1 and 2 threads
    python benchmarks/multiply_peaks.py --threads 4

Needs a C++ compiler and an x86 CPU with AVX2 and FMA; builds once into a temporary folder."""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__attribute__((noinline)) float float32_chains(long iterations) {
  __m256 acc[12];
  const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-9f);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (long t = 0; t < iterations; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
  }
  float sum = 0;
  for (int i = 0; i < 12; ++i) sum += acc[i][0];
  return sum;
}

__attribute__((noinline)) float int8_chains(long iterations) {
  __m256i acc[6], x[6];
  __m256i u = _mm256_set1_epi8(3);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 6; ++i) acc[i] = _mm256_setzero_si256(), x[i] = _mm256_set1_epi8(char(i));
  for (long t = 0; t < iterations; ++t) {
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x[i]), ones));
    asm volatile("" : "+x"(u));  // a new operand each iteration: nothing is hoisted out of the loop
  }
  int sum = 0;
  for (int i = 0; i < 6; ++i) sum += _mm256_extract_epi32(acc[i], 0);
  return float(sum);
}

__attribute__((noinline)) float int16_chains(long iterations) {
  __m256i acc[6], x[6];
  __m256i u = _mm256_set1_epi16(3);
  for (int i = 0; i < 6; ++i) acc[i] = _mm256_setzero_si256(), x[i] = _mm256_set1_epi16(short(i));
  for (long t = 0; t < iterations; ++t) {
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(u, x[i]));
    asm volatile("" : "+x"(u));
  }
  int sum = 0;
  for (int i = 0; i < 6; ++i) sum += _mm256_extract_epi32(acc[i], 0);
  return float(sum);
}

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const long iterations = 100000000;
  const char* names[3] = {"float32 vfmadd231ps", "int8 vpmaddubsw+vpmaddwd", "int16 vpmaddwd"};
  const double macs_per_iteration[3] = {12.0 * 8, 6.0 * 32, 6.0 * 16};
  const int thread_counts[2] = {1, max_threads};
  for (int row = 0; row < (max_threads > 1 ? 2 : 1); ++row) {  // 1 thread, then max_threads
    const int threads = thread_counts[row];
    for (int mix = 0; mix < 3; ++mix) {
      double best = 0;
      for (int round = 0; round < 5; ++round) {
        float sink = 0;
        const double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += mix == 0 ? float32_chains(iterations) : mix == 1 ? int8_chains(iterations) : int16_chains(iterations);
        const double rate = iterations * macs_per_iteration[mix] * threads / (now() - start);
        if (rate > best) best = rate;
        if (sink == 1234.5f) std::printf(" ");
      }
      std::printf("%d thread%s  %-26s %7.1f GMAC/s  (%.1f a thread)\n", threads, threads == 1 ? " " : "s",
                  names[mix], best / 1e9, best / 1e9 / threads);
    }
  }
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="the many-thread row's threads (default 2)")
    parser.add_argument("--cxx", default="c++", help="the C++ compiler (default c++)")
    args = parser.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"multiply_peaks.py times x86's AVX2 instructions; this machine is {platform.machine()}.")
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peaks.cpp", Path(folder) / "peaks"
        source.write_text(SOURCE)
        built = subprocess.run([args.cxx, "-O2", "-march=native", "-mavx2", "-mfma", "-fopenmp", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"could not build the loops with {args.cxx} (a C++ compiler with OpenMP is needed):\n"
                     f"{built.stderr[-2000:]}")
        ran = subprocess.run([str(binary), str(args.threads)], capture_output=True, text=True)
        if ran.returncode != 0:
            sys.exit(f"the loops stopped (exit {ran.returncode}; does this CPU have AVX2 and FMA?):\n{ran.stderr[-2000:]}")
        print(ran.stdout, end="")


if __name__ == "__main__":
    main()
