"""Attention scores on AMX tiles against float32 scores, side by side in one process.

    python benchmarks/attention_scores.py                       # kernel, forwards, chat and RAG
    python benchmarks/attention_scores.py --parts kernel forward
    python benchmarks/attention_scores.py --parts decode --categories chat --per-category 8

Over a bfloat16 KV cache, where a model's linears run on AMX tiles (`--activations amx`, the
default on such CPUs), attention computes its scores on the tiles too (kernels/rowwise.cpp,
amx_scores); kernels.use_amx_scores(False) turns that off, so each measure below runs both ways
in turn, in the same process:

- kernel: one layer's attention (SmolLM2's 9 heads over 3 key/value heads, head_dim 64) for 1 /
  2 / 6 / 11 new positions over 300 / 1000 / 3800 cached tokens: microseconds (the mean of the
  faster half of the calls) and the largest difference from the float32 scores' output;
- forward: SmolLM2 forwards of 1 and 6 tokens after a 250- and a 1000-token prefill (ms, the best
  of three rounds of the faster half);
- decode: plain decoding and the shipped EAGLE head on the bench suite's prompts (greedy), each
  prompt through both settings, their order alternating prompt by prompt: tokens a second and
  the speed-up over plain decoding with each setting, and whether EAGLE's tokens equal plain
  decoding's.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from draftwise.models import loading
from draftwise.models.kernels import native_kernels


def mean_of_faster_half(run, calls: int) -> float:
    times = []
    for _ in range(calls):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    times.sort()
    return sum(times[: calls // 2]) / (calls // 2)


def kernel_part(kernels) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    torch.manual_seed(0)
    print("| cached tokens | new positions | float32 scores (us) | AMX scores (us) | max abs difference |")
    print("|---|---|---|---|---|")
    for context in (300, 1000, 3800):
        keys = torch.randn(kv_heads, context + 32, head_dim).bfloat16()
        values = torch.randn(kv_heads, context + 32, head_dim).bfloat16()
        for positions in (1, 2, 6, 11):
            queries = torch.randn(positions, heads, head_dim)
            causal = torch.empty(0, dtype=torch.bool)
            outputs, costs = [], []
            for amx in (False, True):
                run = lambda: kernels.attention(queries, keys, values, context, causal, head_dim ** -0.5, amx)  # noqa: E731
                for _ in range(50):
                    run()
                costs.append(1e6 * mean_of_faster_half(run, 400))
                outputs.append(run())
            difference = (outputs[0] - outputs[1]).abs().max().item()
            print(f"| {context} | {positions} | {costs[0]:.1f} | {costs[1]:.1f} | {difference:.1e} |", flush=True)


def forward_part(kernels, target) -> None:
    from draftwise.models.base import Segment

    model = target.model
    print("| cached tokens | rows | float32 scores (ms) | AMX scores (ms) |")
    print("|---|---|---|---|")
    for context in (250, 1000):
        cache = model.new_cache(context + 64)
        model.forward(torch.randint(1000, (context,)), torch.arange(context), cache, num_logits=1)
        best: dict[tuple[bool, int], float] = {}
        for _ in range(3):
            for amx in (False, True):
                kernels.use_amx_scores(amx)
                for rows in (1, 6):
                    tokens, positions = torch.randint(1000, (rows,)), torch.arange(context, context + rows)
                    mask = torch.ones(rows, rows, dtype=torch.bool).tril() if rows > 1 else None

                    def run():
                        cache.length = context  # the same slots again: each forward sees the prefill only
                        model.forward_batch([Segment(tokens, positions, cache, mask, None)])
                    for _ in range(3):
                        run()
                    cost = 1000 * mean_of_faster_half(run, 40)
                    best[(amx, rows)] = min(best.get((amx, rows), cost), cost)
        for rows in (1, 6):
            print(f"| {context} | {rows} | {best[(False, rows)]:.2f} | {best[(True, rows)]:.2f} |", flush=True)
    kernels.use_amx_scores(True)


def decode_part(kernels, target, categories: list[str], per_category: int, max_new_tokens: int) -> None:
    from draftwise.bench.suite import default_prompt_dir, load_suite
    from draftwise.config import SamplingParams
    from draftwise.draft_length import DraftLengthPolicy
    from draftwise.drafters.eagle import EagleDrafter
    from draftwise.engine import Engine
    from draftwise.heads import head_for
    from draftwise.heads.eagle import load_head

    head = load_head(head_for("smollm2-135m", "eagle"), target.model)
    engines = {"plain": Engine(target),
               "eagle": Engine(target, EagleDrafter(head, target.model), 16, DraftLengthPolicy())}
    params = SamplingParams(max_new_tokens=max_new_tokens)
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # tokens, seconds, committed, forwards
    mismatches = 0
    for number, prompt in enumerate(load_suite(default_prompt_dir(), categories, per_category)):
        for amx in ((False, True) if number % 2 == 0 else (True, False)):
            kernels.use_amx_scores(amx)
            tokens = {}
            for name, engine in engines.items():
                result = engine.generate(list(prompt.messages), params)
                tokens[name] = result.token_ids
                metrics = result.metrics
                for key in ((name, amx, prompt.category), (name, amx, "all")):
                    row = totals[key]
                    row[0] += metrics.num_generated_tokens
                    row[1] += metrics.total_s
                    row[2] += metrics.num_committed_tokens
                    row[3] += metrics.num_target_forwards
            mismatches += tokens["eagle"] != tokens["plain"]
    kernels.use_amx_scores(True)
    print(f"EAGLE's tokens differ from plain decoding's on {mismatches} runs")
    print("| category | plain, float32 scores | EAGLE, float32 scores | plain, AMX scores | EAGLE, AMX scores |")
    print("|---|---|---|---|---|")
    for category in categories + ["all"]:
        cells = []
        for amx in (False, True):
            plain, eagle = totals[("plain", amx, category)], totals[("eagle", amx, category)]
            plain_rate, eagle_rate = plain[0] / plain[1], eagle[0] / eagle[1]
            cells += [f"{plain_rate:.1f} tok/s",
                      f"{eagle_rate:.1f} tok/s, {eagle_rate / plain_rate:.2f}x ({eagle[2] / eagle[3]:.2f}/fwd)"]
        print(f"| {category} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["kernel", "forward", "decode"],
                        choices=["kernel", "forward", "decode"])
    parser.add_argument("--categories", default="chat,rag_qa")
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None or not kernels.amx_scores_enabled():
        raise SystemExit("attention_scores.py compares AMX scores with float32 ones: this machine has no AMX tiles "
                         "(or the kernels are not built), so there is nothing to compare.")
    target = None
    if "forward" in args.parts or "decode" in args.parts:
        target = loading.load("smollm2-135m", progress=False, activations="amx")
    if "kernel" in args.parts:
        kernel_part(kernels)
    if "forward" in args.parts:
        forward_part(kernels, target)
    if "decode" in args.parts:
        decode_part(kernels, target, args.categories.split(","), args.per_category, args.max_new_tokens)


if __name__ == "__main__":
    main()
