"""The generation methods a benchmark compares, behind one small interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.config import SamplingParams
from draftwise.engine import Engine
from draftwise.metrics import RequestMetrics


@dataclass(slots=True)
class MethodOutput:
    token_ids: list[int]  # generated ids, without a final EOS
    metrics: RequestMetrics | None  # draftwise's speculation statistics; None for peers


class Method(Protocol):
    name: str  # as shown in reports, e.g. "draftwise ngram k=5"
    # The method whose greedy output this one must reproduce token for token (plain decoding
    # on the same weights); None for a method that is itself such a reference.
    reference: str | None

    def run(self, messages: list[dict] | str, max_new_tokens: int) -> MethodOutput:
        ...


class DraftwiseMethod:
    def __init__(self, name: str, engine: Engine, reference: str | None) -> None:
        self.name = name
        self.engine = engine
        self.reference = reference
        self.last_input: list[dict] | str | None = None  # --drafter history: the prompt the mark is for
        self.mark = 0

    def run(self, messages: list[dict] | str, max_new_tokens: int) -> MethodOutput:
        history = getattr(self.engine.drafter, "history", None)  # --drafter history's NgramHistory
        if history is not None:
            # Every run of a prompt (the warm-up, each repeat) drafts from the same history: the
            # earlier prompts' answers, never its own from a run before.
            if messages == self.last_input:
                history.rewind(self.mark)
            else:
                self.last_input, self.mark = messages, history.mark()
        result = self.engine.generate(messages, SamplingParams(max_new_tokens=max_new_tokens))
        return MethodOutput(result.token_ids, result.metrics)


class TransformersMethod:
    """transformers' `generate`, greedy, with the generation options given (prompt lookup,
    assistant model), on the same token ids draftwise sees."""

    reference = "draftwise plain"  # the same float weights, so the same greedy output

    def __init__(self, name: str, model, encode, eos_token_ids: tuple[int, ...], **generate_options) -> None:
        self.name = name
        self.model = model
        self.encode = encode  # messages -> token ids, draftwise's own chat rendering
        self.eos_token_ids = set(eos_token_ids)
        self.generate_options = generate_options

    def run(self, messages: list[dict] | str, max_new_tokens: int) -> MethodOutput:
        input_ids = torch.tensor([self.encode(messages)])
        with torch.no_grad():
            output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                         max_new_tokens=max_new_tokens, pad_token_id=0, **self.generate_options)
        tokens = output[0, input_ids.shape[1]:].tolist()
        ends = [index for index, token in enumerate(tokens) if token in self.eos_token_ids]
        return MethodOutput(tokens[: ends[0]] if ends else tokens, None)


class LlamaCppMethod:
    """llama.cpp through llama-cpp-python, greedy, on the GGUF file itself (its own quantized
    weights, so its output is compared with llama.cpp plain, not with draftwise's)."""

    def __init__(self, name: str, llm, encode, eos_token_ids: tuple[int, ...], reference: str | None) -> None:
        self.name = name
        self.llm = llm  # a llama_cpp.Llama, with or without a prompt-lookup draft model
        self.encode = encode
        self.eos_token_ids = set(eos_token_ids)
        self.reference = reference

    def run(self, messages: list[dict] | str, max_new_tokens: int) -> MethodOutput:
        # Forget the last prompt's keys and values: generate() would otherwise reuse the longest
        # prefix it shares with this one (the chat template's system prompt on every prompt; the
        # whole prompt on the first, which the warm-up ran), and llama.cpp's rows would skip
        # prefill that draftwise's rows pay (draftwise keeps no prompt cache).
        self.llm.reset()
        tokens: list[int] = []
        for token in self.llm.generate(self.encode(messages), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0, reset=True):
            if token in self.eos_token_ids:
                break
            tokens.append(token)
            if len(tokens) == max_new_tokens:  # stop before the generator runs another forward
                break
        return MethodOutput(tokens, None)
