"""Side by side on one machine: plain decoding vs the EAGLE drafter with several tree shapes.

    python benchmarks/eagle_trees.py float32 draftwise/heads/shipped/smollm2-135m/eagle
    python benchmarks/eagle_trees.py int8 draftwise/heads/shipped/smollm2-135m/eagle

Runs the bench suite's chat, math and translation prompts (two each, 96 new tokens) on
SmolLM2-135M with the given activations, plain first, then each (top_k, depth) tree shape with
the adaptive draft-length policy; prints tok/s, the ratio to plain, tokens per target forward
and drafting time per step. The README's EAGLE numbers come from this script.
"""

from __future__ import annotations

import sys

from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.config import SamplingParams
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.eagle import EagleDrafter
from draftwise.engine import Engine
from draftwise.heads.eagle import load_head
from draftwise.models import loading


def run(engine: Engine, prompts: list, params: SamplingParams) -> tuple[float, float, float]:
    tokens = seconds = committed = forwards = draft_s = 0
    for messages in prompts:
        metrics = engine.generate(list(messages), params).metrics
        tokens += metrics.num_generated_tokens
        seconds += metrics.total_s
        committed += metrics.num_committed_tokens
        forwards += metrics.num_target_forwards
        draft_s += metrics.draft_s
    return tokens / seconds, committed / forwards, 1000 * draft_s / forwards


def main(activations: str, head_folder: str) -> None:
    target = loading.load("smollm2-135m", progress=False, activations=activations)
    head = load_head(head_folder, target.model)
    prompts = [p.messages for p in load_suite(default_prompt_dir(), ["chat", "math", "translation"], 2)]
    params = SamplingParams(max_new_tokens=96)
    plain, _, _ = run(Engine(target), prompts, params)
    print(f"{activations} plain {plain:.1f} tok/s")
    for top_k, depth in [(8, 6), (4, 4), (3, 3), (2, 3)]:
        engine = Engine(target, EagleDrafter(head, target.model, top_k=top_k, depth=depth), 16, DraftLengthPolicy())
        speed, per_forward, draft_ms = run(engine, prompts, params)
        print(f"{activations} eagle top_k={top_k} depth={depth}: {speed:.1f} tok/s ({speed / plain:.2f}x), "
              f"{per_forward:.2f} tokens/forward, drafting {draft_ms:.1f} ms/step")


if __name__ == "__main__":
    main(*sys.argv[1:3])
