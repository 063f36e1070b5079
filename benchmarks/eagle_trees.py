"""Side by side on one machine: plain decoding vs the EAGLE drafter with several tree shapes.

    python benchmarks/eagle_trees.py float32 draftwise/heads/shipped/smollm2-135m/eagle
    python benchmarks/eagle_trees.py int8 draftwise/heads/shipped/smollm2-135m/eagle
    python benchmarks/eagle_trees.py auto draftwise/heads/shipped/qwen2.5-coder-1.5b/eagle \
        --model qwen2.5-coder-1.5b --shapes 3x3,2x3,2x2,1x3

Runs the bench suite's chat, math and translation prompts (two each, 96 new tokens) on the
model (default SmolLM2-135M) with the given activations, plain first, then each top_k x depth
tree shape with the adaptive draft-length policy; prints tok/s, the ratio to plain, tokens per
target forward and drafting time per step. docs/heads.md's EAGLE tree numbers come from this script.
"""

from __future__ import annotations

import argparse

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


def main(activations: str, head_folder: str, model: str, shapes: list[tuple[int, int]]) -> None:
    target = loading.load(model, progress=False, activations=activations)
    head = load_head(head_folder, target.model)
    prompts = [p.messages for p in load_suite(default_prompt_dir(), ["chat", "math", "translation"], 2)]
    params = SamplingParams(max_new_tokens=96)
    plain, _, _ = run(Engine(target), prompts, params)
    print(f"{activations} plain {plain:.1f} tok/s")
    for top_k, depth in shapes:
        engine = Engine(target, EagleDrafter(head, target.model, top_k=top_k, depth=depth), 16, DraftLengthPolicy())
        speed, per_forward, draft_ms = run(engine, prompts, params)
        print(f"{activations} eagle top_k={top_k} depth={depth}: {speed:.1f} tok/s ({speed / plain:.2f}x), "
              f"{per_forward:.2f} tokens/forward, drafting {draft_ms:.1f} ms/step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("activations", help="float32, int8, bf16 or auto")
    parser.add_argument("head", help="a head folder (head.json + head.safetensors)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", default="8x6,4x4,3x3,2x3", help="comma-separated TOPKxDEPTH tree shapes")
    args = parser.parse_args()
    main(args.activations, args.head, args.model,
         [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")])
