"""Many prompts one by one (Engine.generate) against all of them in one continuous batch
(Engine.generate_batch), side by side in one process.

    python benchmarks/batch_throughput.py --model smollm2-135m --drafters none,ngram,eagle
    python benchmarks/batch_throughput.py --model qwen2.5-coder-1.5b --per-category 2 --max-new-tokens 64

The bench suite's prompts (--per-category of each of its six categories), greedy, --max-new-tokens
each. For every drafter, rounds alternate which way runs first, so a machine that speeds up or
slows down moves both; prints tokens/s each way (prefill included), their ratio, tokens per target
forward, and how many batched answers differ from the one-by-one ones (greedy: must be 0).
`--drafters history` starts each way with an empty history (rewound), so its prompts draft from
each other's answers only: one by one from the earlier prompts', in the batch live from all.
"""

from __future__ import annotations

import argparse
import time

import draftwise
from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.batch import default_max_batch


def main(model: str, drafters: list[str], per_category: int, max_new_tokens: int, rounds: int,
         max_batch: int | None) -> None:
    prompts = [prompt.input(chat=True) for prompt in load_suite(default_prompt_dir(), None, per_category)]
    params = draftwise.SamplingParams(max_new_tokens=max_new_tokens)
    for name in drafters:
        engine = draftwise.load(model, drafter=name, progress=False)
        chat = bool(engine.tokenizer.chat_template)
        inputs = prompts if chat else [draftwise_text(prompt) for prompt in prompts]
        limit = max_batch or default_max_batch(engine, len(inputs))
        history = getattr(engine.drafter, "history", None)  # --drafter history: each way starts from none
        empty = history.mark() if history is not None else None
        engine.generate(inputs[0], max_new_tokens=8)  # warm: the kernels' first calls, the policy's first costs
        seconds = {"one by one": 0.0, "batch": 0.0}
        tokens = forwards = mismatches = 0
        for round_index in range(rounds):
            order = ["one by one", "batch"] if round_index % 2 == 0 else ["batch", "one by one"]
            outputs = {}
            for way in order:
                if history is not None:
                    history.rewind(empty)  # so no way drafts from the other's answers to the same prompts
                tic = time.perf_counter()
                if way == "batch":
                    outputs[way] = engine.generate_batch(inputs, params, max_batch=limit)
                else:
                    outputs[way] = [engine.generate(prompt, params) for prompt in inputs]
                seconds[way] += time.perf_counter() - tic
            tokens += sum(len(result.token_ids) for result in outputs["batch"])
            forwards += sum(result.metrics.num_target_forwards for result in outputs["batch"])
            mismatches += sum(a.token_ids != b.token_ids for a, b in zip(outputs["batch"], outputs["one by one"]))
        alone, batched = tokens / seconds["one by one"], tokens / seconds["batch"]
        print(f"{model} drafter={name} {len(inputs)} prompts x {max_new_tokens} tokens, max_batch {limit}, "
              f"{rounds} rounds: one by one {alone:.1f} tok/s, batch {batched:.1f} tok/s ({batched / alone:.2f}x), "
              f"{tokens / forwards:.2f} tokens a forward in the batch, {mismatches} mismatches", flush=True)


def draftwise_text(messages: list[dict]) -> str:
    from draftwise.bench.suite import messages_text

    return messages_text(messages)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafters", default="none,ngram", help="comma-separated drafters (none: plain decoding)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch", type=int, help="default: from measured forward costs, as draftwise serve")
    args = parser.parse_args()
    main(args.model, args.drafters.split(","), args.per_category, args.max_new_tokens, args.rounds, args.max_batch)
