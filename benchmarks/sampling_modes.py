"""Rejection vs coupled sampling, side by side: acceptance, tokens per forward and tokens/s per
drafter at temperatures 0.7 and 1.0 on the bench suite, plus a check that coupled output equals
plain coupled decoding token for token.

    python benchmarks/sampling_modes.py --model smollm2-135m --drafters ngram,eagle
    python benchmarks/sampling_modes.py --model qwen2.5-coder-1.5b --drafters model,cross-vocab \
        --draft-model qwen2.5-coder-0.5b --cross-vocab-draft smollm2-135m --draft-length fixed \
        --num-draft-tokens 4 --per-category 1 --max-new-tokens 48

Every (temperature, mode) runs plain decoding first (its speed is the 1.00x), then each drafter,
on the same prompts with the same seeds, in one process.
"""

from __future__ import annotations

import argparse
import sys
import time

from draftwise import SamplingParams, SpecConfig, engine_for
from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.drafters import build_drafter
from draftwise.engine import Engine
from draftwise.models import loading


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafters", default="ngram,eagle")
    parser.add_argument("--draft-model", help="the draft model of the `model` drafter (same tokenizer)")
    parser.add_argument("--cross-vocab-draft", help="the draft model of the `cross-vocab` drafter (another tokenizer)")
    parser.add_argument("--draft-length", default="adaptive", choices=("adaptive", "fixed"),
                        help="fixed verifies every drafted token: acceptance then does not depend on timings")
    parser.add_argument("--num-draft-tokens", type=int, help="most draft tokens per step (default: the drafter's)")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    prompts = load_suite(default_prompt_dir(), per_category=args.per_category)
    target = loading.load(args.model, progress=False)
    engines = {}
    for name in args.drafters.split(","):
        draft_model = {"model": args.draft_model, "cross-vocab": args.cross_vocab_draft}.get(name)
        spec = SpecConfig(drafter=name, draft_model=draft_model, num_draft_tokens=args.num_draft_tokens,
                          draft_length=args.draft_length)
        engines[name] = engine_for(spec, target, build_drafter(spec, target, progress=False))
    plain = Engine(target)
    print(f"{args.model}: {len(prompts)} prompts, {args.max_new_tokens} tokens, seeds 0..{len(prompts) - 1}, "
          f"{args.draft_length} draft length", flush=True)
    print("| temperature | mode | drafter | acceptance | tokens/forward | tok/s | vs plain | same text as plain |")
    print("|---|---|---|---|---|---|---|---|")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for mode in ("rejection", "coupled"):
            def params(seed: int) -> SamplingParams:
                return SamplingParams(temperature=temperature, seed=seed, max_new_tokens=args.max_new_tokens,
                                      sampling_mode=mode)

            reference, plain_rate = None, None
            for name, engine in [("none", plain), *engines.items()]:
                engine.generate(prompts[0].messages, params(0))  # warm-up: kernels, policy costs
                tokens = drafted = accepted = forwards = committed = 0
                outputs, seconds = [], 0.0
                for seed, prompt in enumerate(prompts):
                    started = time.perf_counter()
                    result = engine.generate(list(prompt.messages), params(seed))
                    seconds += time.perf_counter() - started
                    m = result.metrics
                    tokens += m.num_generated_tokens
                    drafted += m.num_draft_tokens
                    accepted += m.num_accepted_tokens
                    forwards += m.num_target_forwards
                    committed += m.num_committed_tokens
                    outputs.append(result.token_ids)
                rate = tokens / seconds
                if name == "none":
                    reference, plain_rate = outputs, rate
                same = sum(a == b for a, b in zip(outputs, reference))
                print(f"| {temperature} | {mode} | {name} | {accepted / drafted if drafted else 0:.1%} | "
                      f"{committed / forwards:.2f} | {rate:.1f} | {rate / plain_rate:.2f}x | {same}/{len(prompts)} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
