"""Cost of each distinct weight matrix of a model through draftwise's linear kernels: microseconds
and multiply-adds per second for a product with 1 / 2 / 4 / 9 / 16 / 256 rows of x (decode, draft
verification, prefill tiles), float32, int8 and bf16 activations. A kernel change shows here first,
one matrix at a time, before it shows in benchmarks/forward_cost.py's whole forwards.

    python benchmarks/kernel_cost.py --model qwen2.5-coder-1.5b --threads 2
    python benchmarks/kernel_cost.py --model smollm2-135m --rows 1 4 16 --activations int8

Matrices are those of the first decoder layer and the LM head, in the model's own formats (the
GGUF file's blocks with --dtype auto). Each time is the minimum over `--repeats` rounds of a
loop long enough to take ~20 ms, so caches are warm as in a decode step that reads the same
matrix again one step later; the weights of a whole model do not fit in cache, so a real
forward reads them from memory and is slower for one row. Judge a change to the decode path
(few rows) by forward_cost.py's whole forwards: one that measured 1.1-1.35x faster here at 9-11
rows was slower in whole SmolLM2 forwards (2026-11-25). Evicting the caches before each
product does not model a forward either (it also lets the threads fall asleep: a 110 KB matrix
then took 43 us instead of 10)."""

from __future__ import annotations

import argparse
import time

import torch

from draftwise.errors import ConfigError
from draftwise.models import loading
from draftwise.models.linear import SETTINGS, BlockLinear, use_activations


def matrices(model) -> dict[str, BlockLinear]:
    """Layer 0's linears and the LM head, by name, once each (a tied head is the embedding's)."""
    named = {f"layers.0.{name}": module for name, module in model.model.layers[0].named_modules()
             if isinstance(module, BlockLinear)}
    named["lm_head"] = model.lm_head
    return named


def product_us(linear: BlockLinear, rows: int, repeats: int) -> float:
    x = torch.randn(rows, linear.weight.num_columns)
    linear(x)
    tic = time.perf_counter()
    linear(x)
    calls = max(1, int(0.02 / max(time.perf_counter() - tic, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        for _ in range(calls):
            linear(x)
        best = min(best, (time.perf_counter() - tic) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="how weights are stored (auto: the GGUF file's blocks)")
    parser.add_argument("--activations", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 9, 16, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = loading.load(args.model, dtype=args.dtype, auto_fetch=True, progress=False)
    named = matrices(target.model)
    print(f"{args.model}, --dtype {args.dtype}, {torch.get_num_threads()} threads: us per product (GMAC/s)")
    print("| matrix | format | activations | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|---|---|" + "---|" * len(args.rows))
    for activations in args.activations:
        try:
            use_activations(target.model, activations)
        except ConfigError as error:  # int8 on float weights: say so and go on
            print(f"| (all) | - | {activations} | {error} |")
            continue
        for name, linear in named.items():
            weight = linear.weight
            cells = []
            for rows in args.rows:
                us = product_us(linear, rows, args.repeats)
                cells.append(f"{us:.0f} ({rows * weight.num_rows * weight.num_columns / us / 1e3:.0f})")
            print(f"| {name} {weight.num_rows}x{weight.num_columns} | {weight.format.name} | {weight.activations} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
