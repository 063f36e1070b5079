"""The decode loop: prefill, then propose -> one target forward -> verify -> commit/rollback.

Plain decoding is the same loop with a drafter that never proposes, so the baseline and the
speculative path share every line that could make their outputs differ.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draftwise.config import SamplingParams
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.base import Draft, Drafter, empty_draft
from draftwise.errors import PromptError
from draftwise.kv_cache import KVCache
from draftwise.metrics import RequestMetrics
from draftwise.models.loading import LoadedModel
from draftwise.sampling import logits_to_probs, make_generator
from draftwise.text_stream import TextStream
from draftwise import tree
from draftwise.verify import Verdict, verify_greedy, verify_rejection, verify_tree_greedy, verify_tree_rejection

Prompt = str | list[dict[str, str]]  # raw text, or chat messages [{"role": ..., "content": ...}]


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids; an EOS token that ended generation is not included
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    metrics: RequestMetrics

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "metrics": self.metrics.to_dict()}


@dataclass(slots=True)
class StreamUpdate:
    delta: str  # text that became final since the previous update
    result: GenerationResult | None = None  # set on the last update only


class NoDrafter:
    """Plain decoding: every step proposes nothing, so each target forward commits one token."""

    sequential = False

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        pass

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        return empty_draft()

    def rollback(self, num_valid: int) -> None:
        pass  # nothing was proposed, so nothing to forget


class Engine:
    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, num_draft_tokens: int = 5,
                 draft_length: DraftLengthPolicy | None = None) -> None:
        """num_draft_tokens is the most a step drafts; with a draft_length policy each step
        verifies the share of the draft that the policy expects to pay off (see
        draftwise.draft_length), without one it verifies every draft token."""
        self.target = target
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        self.num_draft_tokens = num_draft_tokens
        self.draft_length = draft_length
        # Layers whose hidden states the drafter reads (EAGLE, Medusa); () for most drafters.
        self.hidden_layers: tuple[int, ...] = tuple(getattr(self.drafter, "hidden_layers", ()))

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw prompt, or of chat messages rendered by the model's chat template."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: give some text to continue.")
            return list(self.tokenizer.encode(prompt))
        if not prompt or not any(m.get("content", "").strip() for m in prompt):
            raise PromptError("the chat has no message with content: add at least one message.")
        if not self.tokenizer.chat_template:
            raise PromptError(f"{self.target.model.info.name} has no chat template: pass a plain prompt instead.")
        rendered = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        for update in self.stream(prompt, params):
            if update.result is not None:
                return update.result
        raise AssertionError("stream() ended without a result")

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamUpdate]:
        """Generate, yielding text deltas as they become final; the last update has the result."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        model = self.target.model
        max_context = model.info.max_context
        if len(prompt_ids) >= max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but {model.info.name} reads at most "
                f"{max_context}: shorten the prompt."
            )
        # The context never exceeds prompt + max_new_tokens; a verify forward holds k more.
        max_length = min(len(prompt_ids) + params.max_new_tokens, max_context)
        cache = model.new_cache(max_length + self.num_draft_tokens + 1)
        generator = make_generator(params.seed)
        self.drafter.begin(params, generator, max_length + self.num_draft_tokens + 1)
        if self.draft_length is not None:
            self.draft_length.begin_request()
        eos = set(model.info.eos_token_ids)
        metrics = RequestMetrics(num_prompt_tokens=len(prompt_ids))
        text = TextStream(self.tokenizer, params.stop)
        context = torch.tensor(prompt_ids, dtype=torch.long)  # committed tokens: prompt + output

        started = time.perf_counter()
        logits = self._forward(context, torch.arange(context.shape[0]), cache, None, num_logits=1)  # [1, vocab]
        if self.hidden_layers:
            logits, hidden = logits
            self.drafter.observe(hidden)  # [prompt, layers * hidden]: all of it is committed context
        verdict = _choose(empty_draft(), logits, params, generator)
        metrics.prefill_s = time.perf_counter() - started
        new_tokens = [verdict.next_token]
        metrics.record_step(0, 0, 1)
        finish_reason = None
        while True:
            # Commit token by token so that EOS, stop strings and the length limit cut the output
            # at the same place whatever the number of tokens a step produced.
            for token in new_tokens:
                if token in eos:
                    finish_reason = "stop"
                    break
                context = torch.cat((context, torch.tensor([token])))
                if text.push(token):
                    finish_reason = "stop"
                    break
                if len(text.token_ids) >= params.max_new_tokens or context.shape[0] >= max_length:
                    finish_reason = "length"
                    break
            if finish_reason is not None:
                break
            delta = text.delta()
            if delta:
                yield StreamUpdate(delta)
            new_tokens = self._step(context, cache, params, generator, metrics, max_length)
        metrics.num_generated_tokens = len(text.token_ids)
        metrics.total_s = time.perf_counter() - started
        result = GenerationResult(text.text, text.token_ids, finish_reason, metrics)
        yield StreamUpdate(text.delta(final=True), result)

    def _step(self, context: torch.Tensor, cache: KVCache, params: SamplingParams, generator: torch.Generator,
              metrics: RequestMetrics, max_length: int) -> list[int]:
        """One speculative step; returns the tokens it commits (accepted + one of the target's)."""
        num_committed = context.shape[0]
        # Never draft past the request's budget: the step adds accepted + 1 tokens.
        budget = min(self.num_draft_tokens, max_length - num_committed - 1)
        # getattr: a user drafter written without the attribute is treated as free to draft.
        sequential = self.draft_length is not None and getattr(self.drafter, "sequential", False)
        if sequential and budget > 0:
            budget = self.draft_length.choose_before_drafting(budget)  # a draft model pays per token
        tic = time.perf_counter()
        draft = self.drafter.propose(context, budget) if budget > 0 else empty_draft()
        if self.draft_length is not None and draft.tokens.shape[0]:
            if draft.scores is not None:  # a scored tree: as many nodes as pay for their cost
                draft = draft.trimmed(self.draft_length.choose_nodes(draft.key, draft.scores.tolist()))
            elif not sequential:
                draft = draft.trimmed(self.draft_length.choose(draft.key, draft.tokens.shape[0]))
        toc = time.perf_counter()
        if sequential and budget > 0:
            self.draft_length.observe_draft(budget, toc - tic)
        num_proposed = draft.tokens.shape[0]
        # The cache holds every committed token but the last; score it and the draft at once.
        inputs = torch.cat((context[-1:], draft.tokens))  # [1 + n]
        # A chain's depth is its length; a tree node sits one position past its parent.
        depths = tree.depths(draft.parents) if draft.is_tree else torch.arange(1, num_proposed + 1)
        if draft.is_tree:
            # Each node sees only its ancestors.
            positions = num_committed - 1 + torch.cat((torch.zeros(1, dtype=torch.long), depths))
            mask = tree.ancestor_mask(draft.parents)  # [1 + n, 1 + n]
        else:
            positions = torch.arange(num_committed - 1, num_committed + num_proposed)
            mask = None
        logits = self._forward(inputs, positions, cache, mask)  # [1 + n, vocab]
        if self.hidden_layers:
            logits, hidden = logits
        forward_s = time.perf_counter() - toc
        metrics.target_forward_s += forward_s
        verdict = _choose(draft, logits, params, generator)
        path = verdict.accepted_nodes()
        if self.draft_length is not None:
            self.draft_length.observe_forward(1 + num_proposed, forward_s)
            if draft.scores is not None:
                self.draft_length.observe_tree_verdict(draft.key, float(draft.scores.sum()), verdict.num_accepted)
            elif num_proposed:
                self.draft_length.observe_verdict(draft.key, num_proposed, verdict.num_accepted)
        # Roll back, in one place, both caches to the committed prefix they both saw; a tree's
        # accepted path moves next to the committed tokens.
        num_valid = num_committed + verdict.num_accepted
        cache.keep_path(num_committed, path)
        self.drafter.rollback(num_valid)
        if self.hidden_layers:
            self.drafter.observe(hidden[[0] + [node + 1 for node in path]])  # the newly committed rows
        metrics.draft_s += toc - tic
        metrics.verify_s += time.perf_counter() - toc
        metrics.record_step(num_proposed, verdict.num_accepted, verdict.num_accepted + 1,
                            int(depths.max()) if num_proposed else 0)
        return draft.tokens[path].tolist() + [verdict.next_token]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                 num_logits: int | None = None):
        """The target's forward; with a drafter that reads hidden states, (logits, hidden)."""
        if self.hidden_layers:
            return self.target.model.forward(tokens, positions, cache, mask, num_logits, hidden_layers=self.hidden_layers)
        return self.target.model.forward(tokens, positions, cache, mask, num_logits)


def _choose(draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Verdict:
    """Verify a (possibly empty) chain or tree draft against target logits [n + 1, vocab]."""
    if draft.is_tree:
        if params.is_greedy:
            return verify_tree_greedy(draft.tokens, draft.parents, target_logits)
        target_probs = logits_to_probs(target_logits, params)
        return verify_tree_rejection(draft.tokens, draft.parents, draft.probs, target_probs, generator)
    if params.is_greedy:
        return verify_greedy(draft.tokens, target_logits)
    target_probs = logits_to_probs(target_logits, params)  # an empty draft just samples row 0
    return verify_rejection(draft.tokens, draft.probs, target_probs, generator)
