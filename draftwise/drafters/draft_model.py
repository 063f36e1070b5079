"""A smaller model with the target's vocabulary drafts autoregressively from its own cache."""

from __future__ import annotations

import copy

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft
from draftwise.errors import IncompatibleDrafterError
from draftwise.kv_cache import KVCache, carry_entries, shared_prefix_length
from draftwise.models.base import CausalLM, Segment, forward_segments
from draftwise.sampling import coupled_token, logits_to_probs, sample


NOTHING_FED = (torch.empty(0, dtype=torch.long),) * 2


class ModelDrafter:
    sequential = True  # see Drafter.sequential

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        # The token ids the cache's entries were computed from: the last proposal's context and
        # the draft tokens fed after it (rollback keeps the first cache.length of them).
        self.fed: tuple[torch.Tensor, torch.Tensor] = NOTHING_FED
        self.new_request = False
        # Whether a request starts from the last one's entries (set by Engine.prefix_cache: on
        # with prefix caching, off otherwise, so that a benchmark's repeats each start cold).
        self.keep_between_requests = False

    def fork(self) -> "ModelDrafter":
        """A twin for a concurrent request: the same model, a cache of its own (made in begin)."""
        twin = copy.copy(self)
        twin.cache = None
        return twin

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        """A request starts. With keep_between_requests the cache keeps the last request's
        entries, and the first proposal keeps those its context starts with (a chat's next turn
        resends the conversation so far, so only the new turn is fed; on the native decoder the
        same draft either way, by batch invariance); without, it starts empty."""
        self.params = params
        self.generator = generator
        keep = self.keep_between_requests
        if self.cache is None or self.cache.max_length < max_length:
            held, self.cache = self.cache, self.model.new_cache(max_length)
            if keep:  # a longer request
                carry_entries(held, self.cache)
        if not keep:
            self.cache.truncate(0)
        self.new_request = keep

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        return ModelDrafter.propose_together([self], [context], [num_draft_tokens])[0]

    def _keep_shared_prefix(self, context: torch.Tensor) -> None:
        """Truncate the cache to the entries of the tokens this request's context starts with."""
        self.new_request = False
        held = torch.cat(self.fed)[:self.cache.length]
        self.cache.truncate(shared_prefix_length(held, context[:-1]))  # the context's last token is fed anew

    @staticmethod
    def propose_together(drafters: list["ModelDrafter"], contexts: list[torch.Tensor],
                         budgets: list[int]) -> list[Draft]:
        """Drafts for several requests whose drafters share one model (forks of one drafter):
        the catch-up forward and each draft token's forward run ONCE for all of them
        (models.base.Segment, one per request's cache). The native decoder computes every row
        with the same arithmetic whatever else the forward holds, so each request's draft is
        token for token the one it would draft alone; propose() is this with one request."""
        model = drafters[0].model
        for drafter, context in zip(drafters, contexts):
            if drafter.new_request:
                drafter._keep_shared_prefix(context)
            drafter.fed = NOTHING_FED  # until this proposal is complete (an interrupted one leaves nothing to reuse)
        # Catch up on what each draft has not seen: the tokens committed since its last step
        # (usually the target's recovered/bonus token and the draft's last, unfed token).
        segments = [Segment(context[drafter.cache.length:], torch.arange(drafter.cache.length, context.shape[0]),
                            drafter.cache, None, 1) for drafter, context in zip(drafters, contexts)]
        logits = [output[-1] for output in forward_segments(model, segments)]
        tokens: list[list[torch.Tensor]] = [[] for _ in drafters]
        probs: list[list[torch.Tensor]] = [[] for _ in drafters]
        for index in range(max(budgets, default=0)):
            fed = []  # requests whose token `index` is fed (the last draft token is fed only if accepted)
            for i, drafter in enumerate(drafters):
                if index < budgets[i]:
                    token, token_probs = drafter._pick(logits[i], contexts[i].shape[0] + index)
                    tokens[i].append(token)
                    if token_probs is not None:
                        probs[i].append(token_probs)
                    if index + 1 < budgets[i]:
                        fed.append(i)
            if fed:
                segments = [Segment(tokens[i][-1].view(1), torch.tensor([contexts[i].shape[0] + index]), drafters[i].cache)
                            for i in fed]
                for i, output in zip(fed, forward_segments(model, segments)):
                    logits[i] = output[-1]
        drafts = [Draft(torch.stack(chain) if chain else torch.empty(0, dtype=torch.long),
                        torch.stack(rows) if rows else None) for chain, rows in zip(tokens, probs)]
        for drafter, context, draft in zip(drafters, contexts, drafts):
            drafter.fed = (context, draft.tokens)
        return drafts

    def _pick(self, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft token for output position `position` from the draft's logits [vocab], and
        the distribution it was drawn from (None when greedy)."""
        if self.params.is_greedy:
            return logits.argmax(), None
        token_probs = logits_to_probs(logits, self.params)  # [vocab]
        if self.params.is_coupled:  # the target's noise for this position: agree where q ~ p
            return coupled_token(token_probs, self.params.seed, position), token_probs
        return sample(token_probs, self.generator), token_probs

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
