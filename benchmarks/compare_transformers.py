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

import draftwise
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
    params = draftwise.SamplingParams(max_new_tokens=args.max_new_tokens)
    eos = set(target.model.info.eos_token_ids)
    k = args.num_draft_tokens

    methods = {"draftwise plain": Engine(target), f"draftwise ngram k={k}": Engine(target, NgramDrafter(), k)}
    if draft:
        methods[f"draftwise model k={k}"] = Engine(target, ModelDrafter(draft.model), k)
    hf_methods = {"transformers plain": {},
                  f"transformers prompt lookup {args.prompt_lookup_tokens}": {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}}
    if hf_draft:
        hf_methods["transformers assisted"] = {"assistant_model": hf_draft}

    rows = []
    for category, prompt in PROMPTS.items():
        reference = None
        for name, engine in methods.items():
            result, seconds = time_runs(lambda: engine.generate(prompt, params), args.repeats)
            reference = reference if reference is not None else result.token_ids
            rows.append({"category": category, "method": name, "tokens": len(result.token_ids),
                         "tokens_per_second": len(result.token_ids) / seconds,
                         "mean_accepted_length": result.metrics.mean_accepted_length,
                         "acceptance_rate": result.metrics.acceptance_rate,
                         "same_as_plain": result.token_ids == reference})
            print(rows[-1], flush=True)
        input_ids = torch.tensor([methods["draftwise plain"].encode(prompt)])
        for name, extra in hf_methods.items():
            def run():
                with torch.no_grad():
                    out = hf_target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                             max_new_tokens=args.max_new_tokens, pad_token_id=0, **extra)
                tokens = out[0, input_ids.shape[1]:].tolist()
                cut = [i for i, token in enumerate(tokens) if token in eos]
                return tokens[: cut[0]] if cut else tokens
            tokens, seconds = time_runs(run, args.repeats)
            rows.append({"category": category, "method": name, "tokens": len(tokens),
                         "tokens_per_second": len(tokens) / seconds, "mean_accepted_length": None,
                         "acceptance_rate": None, "same_as_plain": tokens == reference})
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
