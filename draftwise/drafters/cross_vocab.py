"""A draft model whose tokenizer differs from the target's, still lossless.

Two algorithms of Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies" (ICML 2025):

- "string" (string-level exact match, their SLEM): the draft continues the committed TEXT in
  its own tokens, greedily; the text it writes is re-tokenised by the target's tokenizer and
  those target tokens are the draft. Every draft token is a point mass, so the usual
  verification (argmax match; or accept with probability target_probs[token]) is lossless at
  any temperature. The draft may use its whole vocabulary.
- "intersection" (token-level intersection, their TLI): the draft's distribution is restricted
  to tokens spelling the same bytes in both vocabularies and renormalised; a sampled draft
  token maps to its target twin, and its probabilities map to the target's ids, so standard
  rejection sampling keeps the target's distribution exactly, with real draft probabilities.
  In coupled sampling the draft picks, among target ids, argmax(log q + g_t) with the target's
  own Gumbel noise g_t for that position (draftwise.sampling.coupled_token), so it agrees with
  the target's token wherever q is close to p.

Either way the draft model keeps its own token sequence for the committed text: each step
re-tokenises the committed text with the draft's tokenizer and keeps the longest cached prefix
that still matches, so rollback happens there (see propose).
"""

from __future__ import annotations

import copy

import torch

from draftwise.config import CROSS_VOCAB_METHODS, SamplingParams
from draftwise.drafters.base import Draft, empty_draft
from draftwise.drafters.text_bridge import continuation_tokens, split_committed
from draftwise.drafters.vocab import PROBE_TEXT, vocabulary_pair
from draftwise.errors import ConfigError, IncompatibleDrafterError
from draftwise.kv_cache import carry_entries
from draftwise.models.base import CausalLM
from draftwise.sampling import coupled_token, logits_to_probs, sample

# "auto": greedy requests use string (measured with a Qwen2.5-Coder-0.5B target on 10 prompts:
# 45% of draft tokens accepted vs 33% for intersection with SmolLM2, 39% vs 31% with Gemma:
# re-tokenising lets the target's own merges through). Sampling requests use intersection when
# the shared tokens cover at least this share of the draft's own tokens on real text (then
# restricting the draft loses little and rejection sampling gets real draft probabilities),
# string otherwise. At temperature 0.7 on the same prompts the two were close: 112 accepted of
# 363 drafted (intersection) vs 102 of 277 (string).
MIN_INTERSECTION_COVERAGE = 0.95


class CrossVocabDrafter:
    sequential = True  # see Drafter.sequential

    def __init__(self, model: CausalLM, draft_tokenizer, target_tokenizer, target_vocab_size: int,
                 method: str = "auto") -> None:
        if method not in CROSS_VOCAB_METHODS:
            raise ConfigError(f"cross-vocab method {method!r} is invalid: use one of {', '.join(CROSS_VOCAB_METHODS)}.")
        self.model = model
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab, self.draft_vocab, self.vocab_map = vocabulary_pair(
            target_tokenizer, target_vocab_size, draft_tokenizer, model.info.vocab_size)
        self.coverage = intersection_coverage(self.vocab_map.in_intersection, draft_tokenizer)
        self.requested_method = method
        self.method = self.method_for(SamplingParams())
        self.intersection = Intersection(self.vocab_map.draft_to_target[: model.info.vocab_size], target_vocab_size)
        self.cache = None
        self.cached_ids: list[int] = []  # the draft token ids whose keys/values the cache holds
        # Whether a request starts from the last one's entries (set by Engine.prefix_cache, as
        # for drafters.draft_model: the catch-up then keeps what the new text starts with).
        self.keep_between_requests = False
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    def fork(self) -> "CrossVocabDrafter":
        """A twin for a concurrent request: the same model, a cache of its own (made in begin)."""
        twin = copy.copy(self)
        twin.cache = None
        twin.cached_ids = []
        return twin

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        self.params = params
        self.generator = generator
        self.method = self.method_for(params)
        # The draft's tokenizer may need more tokens than the target's for the same text.
        capacity = min(2 * max_length + 64, self.model.info.max_context)
        keep = self.keep_between_requests
        if self.cache is None or self.cache.max_length < capacity:
            held, self.cache = self.cache, self.model.new_cache(capacity)
            if not (keep and carry_entries(held, self.cache)):  # a longer request keeps the entries
                self.cached_ids = []
        if not keep:
            self.cache.truncate(0)
            self.cached_ids = []

    def method_for(self, params: SamplingParams) -> str:
        """The algorithm a request with these params runs (see MIN_INTERSECTION_COVERAGE)."""
        if self.requested_method != "auto":
            return self.requested_method
        if params.is_greedy or self.coverage < MIN_INTERSECTION_COVERAGE:
            return "string"
        return "intersection"

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        context_ids = context.tolist()  # one sync per step: text is built on the host
        text, held_back = split_committed(self.target_vocab, context_ids)
        draft_ids = self.draft_tokenizer.encode(text, add_special_tokens=True)
        if (not draft_ids or len(draft_ids) + num_draft_tokens + 1 > self.cache.max_length
                or (held_back and self.method == "intersection")):
            return empty_draft()  # nothing to read, out of draft context, or mid-character: the target goes alone
        logits = self._catch_up(draft_ids)
        if self.method == "intersection":
            return self._propose_intersection(logits, num_draft_tokens, context.shape[0])
        return self._propose_string(logits, num_draft_tokens, context_ids, held_back)

    def rollback(self, num_valid: int) -> None:
        pass  # the next propose re-tokenises the committed text and truncates the cache to match

    def _catch_up(self, draft_ids: list[int]) -> torch.Tensor:
        """Make the cache hold draft_ids, keeping the longest prefix it already holds, and
        return the draft's logits [vocab] for the token after them."""
        keep = 0
        limit = min(len(self.cached_ids), len(draft_ids) - 1)  # at least one token must be fed
        while keep < limit and self.cached_ids[keep] == draft_ids[keep]:
            keep += 1
        self.cache.truncate(keep)
        del self.cached_ids[keep:]  # as the cache, until the forward completes (an interrupted one leaves these)
        pending = torch.tensor(draft_ids[keep:], dtype=torch.long)
        logits = self.model.forward(pending, torch.arange(keep, len(draft_ids)), self.cache, num_logits=1)[-1]
        self.cached_ids = list(draft_ids)
        return logits

    def _feed(self, token: int) -> torch.Tensor:
        position = torch.tensor([len(self.cached_ids)])
        logits = self.model.forward(torch.tensor([token]), position, self.cache)[-1]
        self.cached_ids.append(token)
        return logits

    def _propose_string(self, logits: torch.Tensor, num_draft_tokens: int, context_ids: list[int],
                        held_back: bytes) -> Draft:
        # The draft writes one token more than the budget: the last target token of an
        # open-ended text is dropped (see continuation_tokens).
        written: list[int] = []
        ended = False
        for index in range(num_draft_tokens + 1):
            token = int(logits.argmax())
            if token in self.draft_vocab.special:
                # A control token ends the draft text; it is kept only when the target has a
                # twin for it (e.g. <|im_end|> in both ChatML vocabularies).
                ended = True
                if self.vocab_map.draft_to_target[token] >= 0:
                    written.append(token)
                break
            written.append(token)
            if index < num_draft_tokens:
                logits = self._feed(token)
        draft_bytes = self.draft_vocab.spell(written)
        if not draft_bytes.startswith(held_back):
            return empty_draft()
        tokens = continuation_tokens(self.target_tokenizer, self.target_vocab, context_ids,
                                     draft_bytes[len(held_back):], open_ended=not ended)
        return Draft(torch.tensor(tokens[:num_draft_tokens], dtype=torch.long), None)

    def _propose_intersection(self, logits: torch.Tensor, num_draft_tokens: int, num_committed: int) -> Draft:
        tokens, probs = [], []
        for index in range(num_draft_tokens):
            if self.params.is_greedy:
                token = self.intersection.argmax(logits)
            else:
                draft_probs = self.intersection.restrict(logits, self.params)  # [draft_vocab]
                target_probs = self.intersection.to_target(draft_probs)
                if self.params.is_coupled:  # the target's noise for this position: agree where q ~ p
                    target_id = int(coupled_token(target_probs, self.params.seed, num_committed + index))
                    token = self.intersection.draft_twin(target_id, draft_probs)
                else:
                    token = int(sample(draft_probs, self.generator))
                probs.append(target_probs)
            tokens.append(int(self.intersection.draft_to_target[token]))
            if index + 1 < num_draft_tokens:
                logits = self._feed(token)
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)


class Intersection:
    """The token-level intersection as a draft distribution over the TARGET's ids: the draft's
    distribution restricted to shared tokens and renormalised, then carried to target ids.
    A token sampled from `restrict` and mapped by draft_to_target has exactly the probability
    `to_target` gives it, which is what makes rejection sampling lossless here."""

    def __init__(self, draft_to_target: torch.Tensor, target_vocab_size: int) -> None:
        self.draft_to_target = draft_to_target  # [draft_vocab] long, -1 = no target twin
        self.target_vocab_size = target_vocab_size
        shared = draft_to_target >= 0
        if not bool(shared.any()):
            raise IncompatibleDrafterError(
                "the draft and target vocabularies share no token: use --cross-vocab-method string.")
        # Added to draft logits: -inf outside the intersection. [draft_vocab]
        self.outside = torch.zeros(draft_to_target.shape[0]).masked_fill(~shared, float("-inf"))
        self.shared_draft_ids = shared.nonzero().squeeze(1)  # [num_shared]
        self.shared_target_ids = draft_to_target[self.shared_draft_ids]  # [num_shared]

    def argmax(self, draft_logits: torch.Tensor) -> int:
        return int((draft_logits + self.outside).argmax())

    def draft_twin(self, target_id: int, draft_probs: torch.Tensor) -> int:
        """The draft token spelling target_id that the draft finds most probable (the one fed
        to the draft model when the coupled draft chose target_id)."""
        candidates = self.shared_draft_ids[self.shared_target_ids == target_id]
        return int(candidates[draft_probs[candidates].argmax()])

    def restrict(self, draft_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[draft_vocab] logits -> [draft_vocab] probabilities, zero outside the intersection."""
        return logits_to_probs(draft_logits + self.outside, params)

    def to_target(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[draft_vocab] -> [target_vocab]. Several draft tokens may spell one target token
        (Gemma has both "A" and the byte piece <0x41>): their probabilities add up."""
        target_probs = torch.zeros(self.target_vocab_size)
        return target_probs.index_add_(0, self.shared_target_ids, draft_probs[self.shared_draft_ids])


def intersection_coverage(in_intersection: torch.Tensor, draft_tokenizer) -> float:
    """Share of the draft's own tokens, on a mixed sample of text, that have a target twin."""
    ids = draft_tokenizer.encode(COVERAGE_TEXT + PROBE_TEXT, add_special_tokens=False)
    return float(in_intersection[torch.tensor(ids)].float().mean())


COVERAGE_TEXT = (
    "The committee met on Tuesday to review the budget. Revenue rose 4.2% while costs fell.\n"
    "def parse(line: str) -> dict[str, int]:\n    key, _, value = line.partition('=')\n"
    "    return {key.strip(): int(value)}\n"
    "Bonjour, comment allez-vous ? Das Wetter ist heute schön. ¿Dónde está la estación?\n"
    "Solve: 3x + 7 = 22, so 3x = 15 and x = 5.\n"
)
