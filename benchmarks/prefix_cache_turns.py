"""A multi-turn conversation with and without the prefix cache, turn by turn side by side in ONE
process (a shared VM's drift then moves both alike).

    python benchmarks/prefix_cache_turns.py --model qwen2.5-coder-1.5b
    python benchmarks/prefix_cache_turns.py --model smollm2-135m --drafter eagle --turns 6

The conversation opens with the bench suite's longest RAG prompt (a long, input-grounded first
message) and goes on with short follow-up questions; each turn resends the whole conversation, as
a chat client does. Each turn runs on two engines of the same model and drafter, one without a
prefix cache and one with, and must produce the same tokens (the script stops if not). Prints per
turn the prompt's tokens, how many came from the cache, the prefill and whole-turn seconds of
both, and the totals.
"""

from __future__ import annotations

import argparse

import draftwise
from draftwise.bench.suite import default_prompt_dir, load_suite

FOLLOW_UPS = ["Summarise that in one sentence.", "What else does the text say?", "Thanks. Any caveats?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    opening = max(load_suite(default_prompt_dir(), ["rag_qa"]), key=lambda prompt: len(str(prompt.messages)))
    fresh = draftwise.load(args.model, drafter=args.drafter, progress=False)
    cached = draftwise.load(args.model, drafter=args.drafter, progress=False)
    cached.prefix_cache = draftwise.PrefixCache(1 << 30)
    messages = list(opening.messages)
    totals = {"prefill": [0.0, 0.0], "turn": [0.0, 0.0]}
    for turn in range(args.turns):
        without = fresh.generate(messages, max_new_tokens=args.max_new_tokens)
        with_cache = cached.generate(messages, max_new_tokens=args.max_new_tokens)
        if without.token_ids != with_cache.token_ids:
            raise SystemExit(f"turn {turn + 1}: the prefix cache changed the output (a bug: it must not)")
        a, b = without.metrics, with_cache.metrics
        print(f"turn {turn + 1}: prompt {b.num_prompt_tokens} tokens, {b.num_cached_prompt_tokens} from the cache | "
              f"prefill {a.prefill_s:.2f} -> {b.prefill_s:.2f} s | whole turn {a.total_s:.2f} -> {b.total_s:.2f} s",
              flush=True)
        for name, value_a, value_b in (("prefill", a.prefill_s, b.prefill_s), ("turn", a.total_s, b.total_s)):
            totals[name][0] += value_a
            totals[name][1] += value_b
        messages += [{"role": "assistant", "content": without.text},
                     {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    (prefill_a, prefill_b), (turns_a, turns_b) = totals["prefill"], totals["turn"]
    print(f"{args.turns} turns: prefill {prefill_a:.2f} -> {prefill_b:.2f} s, conversation {turns_a:.2f} -> "
          f"{turns_b:.2f} s ({turns_a / turns_b:.2f}x), the same tokens")


if __name__ == "__main__":
    main()
