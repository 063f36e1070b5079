"""EAGLE heads side by side with plain decoding, prompt by prompt, in one process.

    python benchmarks/heads_side_by_side.py draftwise/heads/shipped/smollm2-135m/eagle OTHER_HEAD
    python benchmarks/heads_side_by_side.py HEAD --shapes 3x3,3x8:0.5,4x8:0.5 --draft-vocab 0,4096

Each prompt of the bench suite's chat, math and translation categories (--per-category each,
96 new tokens, greedy) goes through plain decoding and then every configuration (each head x
tree shape x draft vocabulary x prompt-lookup length; a shape is TOPKxDEPTH, a fixed tree, or TOPKxDEPTH:P, growing only
nodes of path probability >= P, EagleDrafter's min_path_probability) before the next prompt starts, so a machine that speeds up or
slows down during the run (shared CPUs do) moves every column alike. Prints, per configuration
and category, the speed-up over plain decoding and the tokens committed per target forward.
The head comparisons in docs/heads.md come from this script.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.config import SamplingParams
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.eagle import EagleDrafter
from draftwise.engine import Engine
from draftwise.heads.eagle import load_head
from draftwise.models import loading

CATEGORIES = ["chat", "math", "translation"]


def parse_shape(text: str) -> tuple[int, int, float]:
    """"4x8:0.5" -> (4, 8, 0.5); "3x3" -> (3, 3, 0.0), a fixed tree."""
    size, _, threshold = text.partition(":")
    top_k, depth = (int(n) for n in size.split("x"))
    return top_k, depth, float(threshold or 0.0)


def main(model: str, heads: list[str], shapes: list[tuple[int, int, float]], vocabs: list[int],
         lookups: list[int], categories: list[str], per_category: int) -> None:
    target = loading.load(model, progress=False, activations="auto")
    engines = {"plain": Engine(target)}
    for path in heads:
        head = load_head(path, target.model)
        for top_k, depth, threshold in shapes:
            for vocab in vocabs:
                for lookup in lookups:
                    drafter = EagleDrafter(head, target.model, top_k, depth, draft_vocab=vocab or None,
                                           min_path_probability=threshold, lookup=lookup)
                    name = (f"{path} {top_k}x{depth}" + (f":{threshold}" if threshold else "")
                            + (f" vocab {vocab}" if vocab else "") + f" lookup {lookup}")
                    engines[name] = Engine(target, drafter, 16, DraftLengthPolicy())
    params = SamplingParams(max_new_tokens=96)
    # (config, category) -> [tokens, seconds, committed, forwards]
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for prompt in load_suite(default_prompt_dir(), categories, per_category):
        for name, engine in engines.items():
            metrics = engine.generate(list(prompt.messages), params).metrics
            for row in (totals[(name, prompt.category)], totals[(name, "all")]):
                row[0] += metrics.num_generated_tokens
                row[1] += metrics.total_s
                row[2] += metrics.num_committed_tokens
                row[3] += metrics.num_target_forwards
    for name in engines:
        cells = []
        for category in categories + ["all"]:
            tokens, seconds, committed, forwards = totals[(name, category)]
            plain_tokens, plain_seconds, _, _ = totals[("plain", category)]
            speedup = (tokens / seconds) / (plain_tokens / plain_seconds)
            cells.append(f"{category} {speedup:.2f}x ({committed / forwards:.2f}/fwd)")
        speed = totals[(name, "all")][0] / totals[(name, "all")][1]
        print(f"{name}: " + " | ".join(cells) + f" | {speed:.1f} tok/s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", help="head folders (head.json + head.safetensors)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", default="4x8:0.5", help="comma-separated TOPKxDEPTH[:P] tree shapes")
    parser.add_argument("--draft-vocab", default="0", help="comma-separated draft vocabulary sizes (0: all)")
    parser.add_argument("--lookup", default="8", help="comma-separated prompt-lookup lengths (0: none)")
    parser.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated bench categories")
    parser.add_argument("--per-category", type=int, default=4)
    args = parser.parse_args()
    main(args.model, args.heads, [parse_shape(shape) for shape in args.shapes.split(",")],
         [int(n) for n in args.draft_vocab.split(",")], [int(n) for n in args.lookup.split(",")],
         args.categories.split(","), args.per_category)
