"""Tokens committed per target forward of EAGLE heads on the same conversations, greedy, with the
tree size fixed (no draft-length policy), so only the heads differ.

    python benchmarks/heads_acceptance.py draftwise/heads/shipped/smollm2-135m/eagle OTHER_HEAD

The sets: --questions new single-turn questions the target writes itself (Magpie, seed 123, a
seed no training run uses by default) and the bench suite's chat, math and translation prompts
(--per-category each). Each head runs in two tree shapes: 8 x 6 with every level grown and no
prompt lookup (what `draftwise train` measures: what the head knows) and the drafter's default
(4 x 8 grown from path probability 0.5, prompt lookup 8), both verifying 16-node trees. Speed
depends on the machine's forward costs; compare heads with benchmarks/heads_side_by_side.py.
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.drafters.eagle import EagleDrafter
from draftwise.heads.eagle import load_head
from draftwise.models import loading
from draftwise.train.data import write_questions
from draftwise.train.pipeline import acceptance_on

SHAPES = {"8x6 all levels, no lookup": (8, 6, 0.0, 0), "default 4x8:0.5, lookup 8": (4, 8, 0.5, 8)}


def main(model: str, heads: list[str], questions: int, per_category: int, max_new_tokens: int) -> None:
    target = loading.load(model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(target.folder)
    sets = {f"{questions} new questions": write_questions(target, tokenizer, questions, questions, seed=123,
                                                           progress=False)}
    for category in ["chat", "math", "translation"]:
        sets[category] = [list(prompt.messages) for prompt in load_suite(default_prompt_dir(), [category], per_category)]
    loaded = {path: load_head(path, target.model) for path in heads}
    for shape, (top_k, depth, threshold, lookup) in SHAPES.items():
        for path, head in loaded.items():
            factory = lambda: EagleDrafter(head, target.model, top_k, depth,  # noqa: E731
                                           min_path_probability=threshold, lookup=lookup)
            cells = [f"{name} {acceptance_on(target, factory, chats, max_new_tokens)['mean_accepted_length']:.2f}"
                     for name, chats in sets.items()]
            print(f"{shape} | {path}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", help="head folders (head.json + head.safetensors)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    main(args.model, args.heads, args.questions, args.per_category, args.max_new_tokens)
