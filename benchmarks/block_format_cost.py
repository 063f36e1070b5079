"""One matrix's product in Q2_K, Q3_K, Q4_K, Q5_K, IQ4_XS, IQ4_NL, IQ3_S, IQ2_XS and float32
weights, ms (the minimum of --rounds products) for 1 / 4 / 9 / 16 / 64 rows of x, per activation
setting: what a Q2_K, Q3_K_M, Q5_K_M, IQ4_XS, IQ3_M or IQ2_XS file's matrices cost against its
Q4_K_M sibling's and against the float32 copy they were dequantised into before they ran as blocks.
The matrix is one of Qwen2.5-Coder-1.5B's Q4_K tensors, its values re-quantised (tests/q2k.py,
q3k.py, q5k.py, iq4.py), so those hold nearly the same weights (the 2- and 3-bit ones less near);
the lattice formats (IQ3_S, IQ2_XS) hold random lattice points at its scale (tests/lattice.py:
nothing here writes them), which decode at the same cost as a real file's.

    python benchmarks/block_format_cost.py --tensor blk.0.ffn_gate.weight --activations float32,amx

DRAFTWISE_MARCH=x86-64-v3 times the AVX2 build on an AVX-512 CPU."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftwise.models import loading, registry  # noqa: E402
from draftwise.models.gguf_index import read_index  # noqa: E402
from draftwise.models.kernels import describe_machine, machine, native_kernels  # noqa: E402
from draftwise.models.linear import INT8_FORMATS, INT16_FORMATS, BlockWeight, WeightFormat  # noqa: E402
from tests.iq4 import quantize_iq4_nl, quantize_iq4_xs  # noqa: E402
from tests.lattice import random_blocks_like  # noqa: E402
from tests.q2k import quantize_q2_k  # noqa: E402
from tests.q3k import quantize_q3_k  # noqa: E402
from tests.q5k import quantize_q5_k  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor", default="blk.0.ffn_gate.weight", help="a Q4_K tensor of Qwen2.5-Coder-1.5B's file")
    parser.add_argument("--activations", default="float32", help="comma-separated: float32, int8, int16, bf16, amx")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native_kernels()
    loading.resolve("qwen2.5-coder-1.5b", auto_fetch=True, weights=False)
    path = registry.gguf_path("qwen2.5-coder-1.5b")
    entry = next((e for e in read_index(path) if e.name == args.tensor), None)
    if entry is None or entry.format != WeightFormat.Q4_K or len(entry.shape) != 2:
        sys.exit(f"{args.tensor} is not a Q4_K matrix of {path.name}")
    rows, columns = int(entry.shape[1]), int(entry.shape[0])
    data = np.array(np.memmap(path, dtype=np.uint8, mode="r")[entry.offset:entry.offset + entry.num_bytes]).reshape(rows, -1)
    values = quants.dequantize(data, WeightFormat.Q4_K).reshape(rows, columns)
    weights = {"Q2_K": BlockWeight(torch.from_numpy(quantize_q2_k(values)), WeightFormat.Q2_K, columns),
               "Q3_K": BlockWeight(torch.from_numpy(quantize_q3_k(values)), WeightFormat.Q3_K, columns),
               "Q4_K": BlockWeight(torch.from_numpy(data), WeightFormat.Q4_K, columns),
               "Q5_K": BlockWeight(torch.from_numpy(quantize_q5_k(values)), WeightFormat.Q5_K, columns),
               "IQ4_XS": BlockWeight(torch.from_numpy(quantize_iq4_xs(values)), WeightFormat.IQ4_XS, columns),
               "IQ4_NL": BlockWeight(torch.from_numpy(quantize_iq4_nl(values)), WeightFormat.IQ4_NL, columns),
               **{format.name: BlockWeight(torch.from_numpy(random_blocks_like(values, format, np.random.default_rng(0))),
                                           format, columns) for format in (WeightFormat.IQ3_S, WeightFormat.IQ2_XS)},
               "float32": BlockWeight.from_float(torch.from_numpy(values), WeightFormat.F32)}
    print(f"{args.tensor}: {rows} x {columns}, {args.threads} threads, on {describe_machine(machine())}")
    for activations in args.activations.split(","):
        print(f"\n{activations} activations (formats without an int8 / int16 path keep float32 under those)\n")
        print("| rows of x | " + " | ".join(weights) + " |")
        print("|---|" + "---|" * len(weights))
        for num_rows in (1, 4, 9, 16, 64):
            x = torch.randn(num_rows, columns)
            cells = []
            for name, weight in weights.items():
                integer_formats = {"int8": INT8_FORMATS, "int16": INT16_FORMATS}.get(activations)
                pathless = integer_formats is not None and weight.format not in integer_formats
                weight.activations = "float32" if pathless else activations
                best = float("inf")
                for _ in range(args.rounds):
                    tic = time.perf_counter()
                    weight.matmul(x)
                    best = min(best, time.perf_counter() - tic)
                cells.append(f"{best * 1000:.3f}")
            print(f"| {num_rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
