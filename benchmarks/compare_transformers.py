"""Side by side, in ONE process: draftwise (plain, ngram, model drafter) against transformers'
`generate` (plain, prompt lookup, assisted generation) on a code-edit and an open chat prompt.

    python benchmarks/compare_transformers.py --target smollm2-135m
    python benchmarks/compare_transformers.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16

Greedy decoding, same prompts, same max_new_tokens; one warm-up, then the median of --repeats
timed runs (prefill included). Every output is compared with draftwise's plain greedy output.
Prints a markdown table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftwise.bench.methods import DraftwiseMethod, TransformersMethod
from draftwise.drafters import ModelDrafter, NgramDrafter
from draftwise.engine import Engine
from draftwise.models import loading

PROMPTS = {
    "code-edit": [{"role": "user", "content": (
        "Rename the function `calc` to `compute_total` and the variable `lst` to `prices` everywhere "
        "in this code. Reply with the full updated code only.\n\n```python\n"
        "def calc(lst, tax):\n    total = 0\n    for item in lst:\n        total += item\n"
        "    total = total * (1 + tax)\n    return round(total, 2)\n\n\n"
        "def report(lst):\n    value = calc(lst, 0.2)\n    print(f\"{len(lst)} items, total {value}\")\n"
        "    return value\n```")}],
    "open-chat": [{"role": "user", "content": "What are some good ways to stay focused while working from home?"}],
}


def time_runs(run, repeats: int):
    run()  # warm-up: first calls allocate and fill caches
    results, seconds = [], []
    for _ in range(repeats):
        tic = time.perf_counter()
        results.append(run())
        seconds.append(time.perf_counter() - tic)
    return results[-1], statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", help="same-vocabulary draft model for the model drafter and assisted generation")
    parser.add_argument("--dtype", default="float32", choices=list(loading.DTYPES))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    torch_dtype = loading.parse_dtype(args.dtype)
    target = loading.load(args.target, dtype=args.dtype)
    hf_target = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch_dtype).eval()
    draft = loading.load(args.draft, dtype=args.dtype) if args.draft else None
    hf_draft = AutoModelForCausalLM.from_pretrained(draft.folder, dtype=torch_dtype).eval() if draft else None
    eos = set(target.model.info.eos_token_ids)
    k = args.num_draft_tokens

    methods = [DraftwiseMethod("draftwise plain", Engine(target)),
               DraftwiseMethod(f"draftwise ngram k={k}", Engine(target, NgramDrafter(), k))]
    if draft:
        methods.append(DraftwiseMethod(f"draftwise model k={k}", Engine(target, ModelDrafter(draft.model), k)))
    encode = methods[0].engine.encode
    methods.append(TransformersMethod("transformers plain", hf_target, encode, eos))
    methods.append(TransformersMethod(f"transformers prompt lookup {args.prompt_lookup_tokens}", hf_target, encode,
                                      eos, prompt_lookup_num_tokens=args.prompt_lookup_tokens))
    if hf_draft:
        methods.append(TransformersMethod("transformers assisted", hf_target, encode, eos, assistant_model=hf_draft))

    rows = []
    for category, prompt in PROMPTS.items():
        reference = None
        for method in methods:
            output, seconds = time_runs(lambda: method.run(prompt, args.max_new_tokens), args.repeats)
            reference = reference if reference is not None else output.token_ids
            metrics = output.metrics
            rows.append({"category": category, "method": method.name, "tokens": len(output.token_ids),
                         "tokens_per_second": len(output.token_ids) / seconds,
                         "mean_accepted_length": metrics.mean_accepted_length if metrics else None,
                         "acceptance_rate": metrics.acceptance_rate if metrics else None,
                         "same_as_plain": output.token_ids == reference})
            print(rows[-1], flush=True)

    plain = {row["category"]: row["tokens_per_second"] for row in rows if row["method"] == "transformers plain"}
    lines = [f"target {args.target}, draft {args.draft or '-'}, {args.dtype}, {torch.get_num_threads()} threads, "
             f"max_new_tokens {args.max_new_tokens}", "",
             "| prompt | method | tokens | tok/s | vs transformers plain | tokens/forward | acceptance | same output as plain |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mal = "" if row["mean_accepted_length"] is None else f"{row['mean_accepted_length']:.2f}"
        acc = "" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f}%"
        lines.append(f"| {row['category']} | {row['method']} | {row['tokens']} | {row['tokens_per_second']:.2f} | "
                     f"{row['tokens_per_second'] / plain[row['category']]:.2f}x | {mal} | {acc} | {row['same_as_plain']} |")
    table = "\n".join(lines)
    print(table)
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    stem = f"compare-{args.target}-{args.dtype}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    (out_dir / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
