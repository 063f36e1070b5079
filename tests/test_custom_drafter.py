"""A user's own drafter (examples/custom_drafter.py) runs through draftwise.load and Engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import draftwise
from draftwise.engine import Engine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_drafter.py"


def load_example():
    spec = importlib.util.spec_from_file_location("custom_drafter", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_documented_custom_drafter_is_lossless_and_really_drafts(smollm2):
    example = load_example()
    reference = "def area(width, height):\n    return width * height\n"
    prompt = [{"role": "user", "content": f"Repeat this code exactly:\n\n{reference}"}]
    params = draftwise.SamplingParams(max_new_tokens=40)
    expected = Engine(smollm2).generate(prompt, params).token_ids
    engine = Engine(smollm2, example.ReferenceDrafter(smollm2.tokenizer, reference), num_draft_tokens=8)
    result = engine.generate(prompt, params)
    assert result.token_ids == expected
    assert result.metrics.num_accepted_tokens > 0


def test_load_accepts_a_drafter_object():
    example = load_example()
    plain = draftwise.load("smollm2-135m", drafter="none", dtype="float32", progress=False)
    engine = draftwise.load("smollm2-135m", drafter=example.ReferenceDrafter(plain.tokenizer, "hello world"),
                            dtype="float32", progress=False)
    assert isinstance(engine.drafter, example.ReferenceDrafter)
    assert engine.draft_length is not None  # the adaptive policy trims a custom drafter's drafts too
