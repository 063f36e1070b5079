"""Random greedy-equality sweep: speculation against plain decoding on prompts nobody wrote.

The tests check greedy equality on fixed prompts; this runs for a given time on random ones, as
a check after a kernel or engine change. Each round the target itself writes a prompt (a seeded,
sampled continuation of one of a few openings: prose, code, lists, markup), then every drafter,
with the adaptive and the fixed draft length, decodes it greedily for a random 1-300 new tokens
(eos ignored half the time); each output must be the plain output's tokens exactly. Prints a line
per round and every mismatch (drafter, prompt, length); exit status 1 if any.

    python benchmarks/greedy_sweep.py --model smollm2-135m --drafters ngram,eagle,medusa --minutes 20
    python benchmarks/greedy_sweep.py --model qwen2.5-coder-1.5b --drafters ngram,eagle,model \\
        --draft-model qwen2.5-coder-0.5b --activations int8 --minutes 18

Each (drafter, draft length) holds its own copy of the model: mind the memory with large ones."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import draftwise
from draftwise import SamplingParams

OPENINGS = ["Once upon a time", "def parse(", "The results show", "Question:", "import numpy as np\n",
            "1, 2, 3,", "In 1848,", "<html>", "Dear team,", "SELECT"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafters", default="ngram,eagle,medusa", help="comma-separated drafter names")
    parser.add_argument("--draft-model", default=None, help="for the model drafter")
    parser.add_argument("--activations", default="auto")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep drawing prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = [name.strip() for name in args.drafters.split(",") if name.strip()]
    if "model" in drafters and args.draft_model is None:
        parser.error("the model drafter needs --draft-model")
    plain = draftwise.load(args.model, drafter="none", activations=args.activations, progress=False)
    engines = {}
    for name in drafters:
        extra = {"draft_model": args.draft_model} if name == "model" else {}
        for length in ("adaptive", "fixed"):
            engines[f"{name} {length}"] = draftwise.load(args.model, drafter=name, draft_length=length,
                                                         activations=args.activations, progress=False, **extra)
    print(f"{args.model}, activations {plain.target.activations}: {', '.join(engines)} against plain decoding",
          flush=True)
    rng = random.Random(args.seed)
    start, compared, mismatches = time.time(), 0, 0
    while time.time() - start < args.minutes * 60:
        opening = rng.choice(OPENINGS)
        written = plain.generate(opening, SamplingParams(max_new_tokens=rng.randint(5, 200), temperature=1.0,
                                                         seed=rng.randint(0, 10**6)))
        prompt = opening + written.text
        params = SamplingParams(max_new_tokens=rng.randint(1, 300), ignore_eos=rng.random() < 0.5)
        reference = list(plain.generate(prompt, params).token_ids)
        for name, engine in engines.items():
            compared += 1
            if list(engine.generate(prompt, params).token_ids) != reference:
                mismatches += 1
                print(f"MISMATCH {name}: {params.max_new_tokens} tokens after {prompt[:80]!r}", flush=True)
        print(f"{time.time() - start:5.0f} s: {compared} compared, {mismatches} mismatches "
              f"(last: {len(prompt)} characters, {params.max_new_tokens} new tokens)", flush=True)
    print(f"done: {compared} outputs compared with plain decoding, {mismatches} mismatches")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
