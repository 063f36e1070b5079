"""Gemma 3 270M on the native decoder, in the default activations of the CPU it runs on: greedy
speculation (chains and trees) equals plain greedy decoding token for token, past its 512-token
sliding window too (models/llama.py's Gemma 3 path; its logits against transformers' are in
test_model_parity.py)."""

from __future__ import annotations

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.drafters import NgramDrafter
from draftwise.engine import Engine
from tests.conftest import PROMPTS
from tests.test_tree_engine import HiddenPathTreeDrafter

PARAMS = SamplingParams(max_new_tokens=32)
# Gemma 3 270M is a base model: plain text, no chat template. The last prompt (~700 tokens) puts
# every step past the local layers' 512-token window.
GEMMA_PROMPTS = [p if isinstance(p, str) else p[-1]["content"] for p in PROMPTS[:3]] + [
    "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value.strip()\n\n" * 24
    + "def parse_all(lines):\n"]


@pytest.fixture(scope="module")
def gemma_default():
    from draftwise.models import loading

    return loading.load("gemma3-270m", auto_fetch=True, progress=False)  # its blocks, the CPU's default activations


@pytest.fixture(scope="module")
def plain_outputs(gemma_default) -> list[list[int]]:
    engine = Engine(gemma_default)
    return [engine.generate(prompt, PARAMS).token_ids for prompt in GEMMA_PROMPTS]


def test_gemma3_runs_natively_past_its_window(gemma_default):
    from draftwise.models.llama import LlamaModel

    model = gemma_default.model
    assert isinstance(model, LlamaModel) and model.shape.sliding_window == 512
    assert len(Engine(gemma_default).encode(GEMMA_PROMPTS[-1])) > 600


def test_gemma3_ngram_speculation_equals_plain_greedy(gemma_default, plain_outputs):
    engine = Engine(gemma_default, NgramDrafter(), 8)
    results = [engine.generate(prompt, PARAMS) for prompt in GEMMA_PROMPTS]
    assert [result.token_ids for result in results] == plain_outputs
    assert results[-1].metrics.num_accepted_tokens > 0  # the long prompt's copy was drafted


def test_gemma3_tree_speculation_equals_plain_greedy(gemma_default, plain_outputs):
    plain = Engine(gemma_default)
    sequences = [plain.encode(prompt) + output for prompt, output in zip(GEMMA_PROMPTS, plain_outputs)]
    drafter = HiddenPathTreeDrafter(sequences, seed=3)
    engine = Engine(gemma_default, drafter, num_draft_tokens=12)
    results = [engine.generate(prompt, PARAMS) for prompt in GEMMA_PROMPTS]
    assert [result.token_ids for result in results] == plain_outputs
    assert sum(r.metrics.num_accepted_tokens for r in results) > len(GEMMA_PROMPTS)
    assert drafter.num_scattered_accepts > 0  # paths were compacted, not just prefixes kept


def test_gemma3_positions_past_the_window_are_the_same_bits_however_computed(gemma_default):
    """In every activation mode this CPU runs: a 700-token prefill's logits at positions 690-699
    equal a 5-token chunk's and one-token steps' after a 690-token prefill (the local layers'
    window cuts each of them at a different place)."""
    from draftwise.models.kernels import native_kernels
    from draftwise.models.linear import use_activations

    model = gemma_default.model
    modes = ["float32", "int8", "int16", "bf16"] + (["amx"] if native_kernels(progress=False).amx_in_hardware() else [])
    ids = torch.randint(100, 20_000, (700,), generator=torch.Generator().manual_seed(0))
    try:
        for mode in modes:
            use_activations(model, mode)
            whole = model.forward(ids, torch.arange(700), model.new_cache(700))
            cache = model.new_cache(700)
            model.forward(ids[:690], torch.arange(690), cache, num_logits=1)
            chunk = model.forward(ids[690:695], torch.arange(690, 695), cache)
            steps = [model.forward(ids[p:p + 1], torch.tensor([p]), cache) for p in range(695, 700)]
            assert torch.equal(chunk, whole[690:695]), mode
            assert torch.equal(torch.cat(steps), whole[695:700]), mode
    finally:
        use_activations(model, gemma_default.activations)
