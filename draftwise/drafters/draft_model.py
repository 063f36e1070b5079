"""A smaller model with the target's vocabulary drafts autoregressively from its own cache."""

from __future__ import annotations

import copy

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft
from draftwise.errors import IncompatibleDrafterError
from draftwise.kv_cache import KVCache
from draftwise.models.base import CausalLM
from draftwise.sampling import gumbel_noise, logits_to_probs, sample


class ModelDrafter:
    sequential = True  # see Drafter.sequential

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    def fork(self) -> "ModelDrafter":
        """A twin for a concurrent request: the same model, a cache of its own (made in begin)."""
        twin = copy.copy(self)
        twin.cache = None
        return twin

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        self.params = params
        self.generator = generator
        if self.cache is None or self.cache.max_length < max_length:
            self.cache = self.model.new_cache(max_length)
        self.cache.truncate(0)

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        cache = self.cache
        # Catch up on what the draft has not seen: the tokens committed since the last step
        # (usually the target's recovered/bonus token and the draft's last, unfed token).
        start = cache.length
        pending = context[start:]
        logits = self.model.forward(pending, torch.arange(start, context.shape[0]), cache, num_logits=1)[-1]
        tokens, probs = [], []
        for index in range(num_draft_tokens):
            if self.params.is_greedy:
                token = logits.argmax()
            else:
                token_probs = logits_to_probs(logits, self.params)  # [vocab]
                if self.params.is_coupled:  # the target's noise for this position: agree where q ~ p
                    noise = gumbel_noise(self.params.seed, context.shape[0] + index, token_probs.shape[-1])
                    token = (token_probs.log() + noise).argmax()
                else:
                    token = sample(token_probs, self.generator)
                probs.append(token_probs)
            tokens.append(token)
            if index + 1 < num_draft_tokens:  # the last draft token is fed only if accepted
                position = torch.tensor([context.shape[0] + index])
                logits = self.model.forward(token.view(1), position, cache)[-1]
        return Draft(torch.stack(tokens), torch.stack(probs) if probs else None)

    def rollback(self, num_valid: int) -> None:
        self.cache.truncate(num_valid)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if target_vocab_size != draft_vocab_size or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise IncompatibleDrafterError(
            f"the draft model's vocabulary ({draft_vocab_size} ids) differs from the target's "
            f"({target_vocab_size} ids), so its token ids cannot be verified by the target. Use "
            "--drafter cross-vocab, which translates between the two tokenizers; or a draft from "
            "the same model family (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b); or --drafter "
            "ngram, which needs no draft model."
        )
