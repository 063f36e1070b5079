"""How close each weight format and activation mode computes a model's logits to the float32 path
(weights dequantised to float32, float32 activations), over the tests' 12 prompts: every
position of the prompt and of a 24-token greedy continuation (teacher-forced in one forward,
which batch invariance makes equal to decoding token by token).

    python benchmarks/numerics.py --model qwen2.5-coder-1.5b --threads 2

Reports, per mode: max |logit difference|, top-1 agreement, and mean KL(float32 || mode) in nats.
Modes: the GGUF blocks with each --activations (float32, int8, bf16, amx where the CPU has
tiles), each with each --kv-cache (float32, bf16: keys and values stored in bfloat16)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftwise.bench.suite import messages_text  # noqa: E402
from draftwise.config import SamplingParams  # noqa: E402
from draftwise.engine import Engine  # noqa: E402
from draftwise.kv_cache import KV_CACHES  # noqa: E402
from draftwise.models import loading  # noqa: E402
from draftwise.models.linear import SETTINGS, use_activations  # noqa: E402
from tests.conftest import PROMPTS  # noqa: E402
from tests.test_model_parity import prompt_ids  # noqa: E402


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, torch.arange(ids.shape[0]), model.new_cache(ids.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--activations", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    stored = [name for name in KV_CACHES if name != "auto"]  # numerics of each dtype, not the default's choice
    parser.add_argument("--kv-cache", nargs="+", default=stored, choices=stored)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = loading.load(args.model, dtype="float32", progress=False)
    blocks = loading.load(args.model, dtype="auto", progress=False)
    sequences = []
    prompts = PROMPTS
    if not getattr(reference.tokenizer, "chat_template", None):  # a base model (Gemma 3 270M): the messages' text
        prompts = [p if isinstance(p, str) else messages_text(p) for p in PROMPTS]
    for prompt in prompts:
        ids = prompt_ids(reference.tokenizer, prompt)
        continuation = Engine(reference).generate(prompt, SamplingParams(max_new_tokens=args.new_tokens)).token_ids
        sequences.append(torch.cat((ids, torch.tensor(continuation, dtype=torch.long))))
    expected = [logits_of(reference.model, ids) for ids in sequences]
    for activations, kv_cache in [(a, c) for a in args.activations for c in args.kv_cache]:
        use_activations(blocks.model, activations)
        blocks.model.cache_dtype = KV_CACHES[kv_cache]
        max_diff, agree, kl, count = 0.0, 0, 0.0, 0
        for ids, ref in zip(sequences, expected):
            got = logits_of(blocks.model, ids)
            max_diff = max(max_diff, (got - ref).abs().max().item())
            agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
            log_p, log_q = ref.log_softmax(-1).double(), got.log_softmax(-1).double()
            kl += (log_p.exp() * (log_p - log_q)).sum().item()
            count += ids.shape[0]
        print(f"{args.model} blocks, {activations} activations, {kv_cache} KV cache vs float32 path: {count} positions | max |logit diff| "
              f"{max_diff:.4f} | top-1 agreement {agree / count:.4f} | mean KL {kl / count:.2e} nats", flush=True)


if __name__ == "__main__":
    main()
