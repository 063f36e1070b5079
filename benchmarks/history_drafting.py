"""--drafter history against plain decoding and prompt lookup (ngram), side by side in one process,
as the history grows: what a server gains from the answers it has already written.

    python benchmarks/history_drafting.py --model smollm2-135m --warm 0,100,400
    python benchmarks/history_drafting.py --model qwen2.5-coder-1.5b --warm 0,160 --per-category 2 --max-new-tokens 64

The history is warmed with the target's own answers to questions it writes itself (Magpie, as
`draftwise train` writes its data: nothing from the bench suite), answered in one batch through
the history engine, up to each --warm size in turn. After each, every prompt of the bench suite
(--categories, --per-category of each) runs through plain decoding, `ngram` and `history`, in that
order, one prompt at a time; `history` drafts from the warm answers and is rewound after each
prompt (no prompt drafts from another's answer, nor from its own). Prints per category tokens/s
(prefill included), each drafter's ratio to plain decoding, tokens per target forward, and how
many outputs differ from plain decoding's (greedy: must be 0).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import draftwise
from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.config import SpecConfig
from draftwise.drafters import NgramDrafter
from draftwise.drafters.history import HistoryDrafter, NgramHistory
from draftwise.models import loading
from draftwise.train.data import write_questions


def main(model: str, warm_sizes: list[int], categories: list[str] | None, per_category: int, max_new_tokens: int,
         out: Path | None) -> None:
    target = loading.load(model, progress=False)
    plain = draftwise.engine_for(SpecConfig(drafter="none"), target, None)
    ngram = draftwise.engine_for(SpecConfig(drafter="ngram"), target, NgramDrafter())
    history = NgramHistory()
    engine = draftwise.engine_for(SpecConfig(drafter="history"), target, HistoryDrafter(history))
    prompts = load_suite(default_prompt_dir(), categories, per_category)
    params = draftwise.SamplingParams(max_new_tokens=max_new_tokens)
    questions = write_questions(target, target.tokenizer, max(warm_sizes), 16, seed=2026) if max(warm_sizes) else []
    plain.generate(prompts[0].input(chat=True), max_new_tokens=8)  # warm: the kernels' first calls
    report, answered = [], 0
    for size in warm_sizes:
        tic = time.perf_counter()
        engine.generate_batch(questions[answered:size], params)
        print(f"{model}: history warmed with {size} answers ({len(history)} tokens, {len(history.table)} contexts; "
              f"the last {size - answered} in {time.perf_counter() - tic:.0f} s)", flush=True)
        answered = size
        rows = {}
        for prompt in prompts:
            row = rows.setdefault(prompt.category, {name: [0, 0, 0.0, 0] for name in ("plain", "ngram", "history")})
            reference = None
            for name, each in (("plain", plain), ("ngram", ngram), ("history", engine)):
                mark = history.mark()
                tic = time.perf_counter()
                result = each.generate(prompt.input(chat=True), params)
                seconds = time.perf_counter() - tic
                history.rewind(mark)
                reference = reference or result.token_ids
                tokens, forwards, total, mismatches = row[name]
                row[name] = [tokens + len(result.token_ids), forwards + result.metrics.num_target_forwards,
                             total + seconds, mismatches + (result.token_ids != reference)]
        for category, row in rows.items():
            plain_rate = row["plain"][0] / row["plain"][2]
            cells = [f"plain {plain_rate:.1f} tok/s"]
            for name in ("ngram", "history"):
                tokens, forwards, seconds, mismatches = row[name]
                cells.append(f"{name} {tokens / seconds / plain_rate:.2f}x ({tokens / forwards:.2f} a forward, "
                             f"{mismatches} mismatches)")
            print(f"  {category}: " + ", ".join(cells), flush=True)
            report.append({"warm_answers": size, "history_tokens": len(history), "category": category,
                           **{name: dict(zip(("tokens", "forwards", "seconds", "mismatches"), values))
                              for name, values in row.items()}})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "history_drafting.json").write_text(json.dumps({"model": model, "max_new_tokens": max_new_tokens,
                                                              "threads": torch.get_num_threads(), "rows": report},
                                                             indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--warm", default="0,100,400", help="comma-separated history sizes, in answers (ascending)")
    parser.add_argument("--categories", help="comma-separated bench categories (default: all six)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="a folder to write history_drafting.json into")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(size) for size in args.warm.split(",")]
    if sizes != sorted(sizes) or sizes[0] < 0:
        parser.error(f"--warm {args.warm}: give history sizes in answers, ascending, from 0")
    main(args.model, sizes, args.categories.split(",") if args.categories else None, args.per_category,
         args.max_new_tokens, args.out)
