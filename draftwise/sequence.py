"""One request's state while it decodes: committed tokens, cache, drafter, random stream, text.

A Sequence is what the batched step (draftwise.step) advances: the single-request Engine runs
one at a time, the server's scheduler many. Everything a request owns lives here, so that a
request's output depends on nothing else in the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from draftwise.config import SamplingParams
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.base import Drafter
from draftwise.kv_cache import KVCache
from draftwise.logprobs import TokenLogprob, token_logprob
from draftwise.metrics import RequestMetrics
from draftwise.structured import Constraint
from draftwise.text_stream import TextStream

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    drafter: Drafter
    policy: DraftLengthPolicy | None  # None: verify every draft token (draft_length="fixed")
    num_draft_tokens: int  # the most a step drafts for this request (0: plain decoding)
    generator: torch.Generator  # this request's own random stream
    cache: KVCache
    max_length: int  # prompt + output never exceeds it
    eos: frozenset[int]
    text: TextStream
    metrics: RequestMetrics
    context: torch.Tensor = field(init=False)  # committed tokens: prompt, then output
    num_prefilled: int = 0  # prompt tokens already in the cache
    finish_reason: str | None = None  # "stop" or "length" once finished; "cancelled" if dropped; "error"
    error: Exception | None = None  # what failed this request alone ("error"; see fail)
    stop_token: int | None = None  # the end-of-sequence token that finished it (not in the output)
    started: float = field(default_factory=time.perf_counter)
    # The hidden-state rows the drafter observed, in context order, kept for a prefix cache
    # (draftwise.prefix_cache) when the drafter reads them; None: not kept.
    hidden_rows: list[torch.Tensor] | None = None
    # The grammar's parser where params.grammar is set (draftwise.structured), at the committed output.
    constraint: Constraint | None = None
    # Each output token's log-probability (params.logprobs set), in step with text.token_ids.
    logprobs: list[TokenLogprob] | None = field(init=False)
    # Each prompt token's, given the ones before it (params.prompt_logprobs set); None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = field(init=False)

    def __post_init__(self) -> None:
        self.context = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.logprobs = [] if self.params.logprobs is not None else None
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None

    def observe_prompt(self, rows: range, logits: torch.Tensor) -> None:
        """A prefilled chunk's logits [len(rows), vocab]: row j predicts prompt token rows.start + j + 1."""
        count = self.params.prompt_logprobs
        for j, position in enumerate(range(rows.start + 1, min(rows.stop + 1, len(self.prompt_ids)))):
            self.prompt_logprobs.append(token_logprob(logits[j], self.prompt_ids[position], count))

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def observe(self, hidden: torch.Tensor) -> None:
        """The target's hidden states [rows, features] of rows that became committed context:
        to the drafter, and kept where hidden_rows is."""
        self.drafter.observe(hidden)
        if self.hidden_rows is not None:
            self.hidden_rows.append(hidden)

    def commit(self, tokens: list[int], logits: torch.Tensor | None = None) -> None:
        """Append a step's tokens one by one, so that EOS, stop strings and the length limit
        cut the output at the same place whatever the number of tokens a step produced.
        logits: the target's row that chose each token [len(tokens), vocab], for logprobs."""
        for index, token in enumerate(tokens):
            if token in self.eos:
                self.stop_token = token
                self.finish("stop")
                return
            self.context = torch.cat((self.context, torch.tensor([token])))
            if self.constraint is not None:
                self.constraint.consume(token)
            if self.logprobs is not None:
                self.logprobs.append(token_logprob(logits[index], token, self.params.logprobs))
            if self.text.push(token):
                self.finish("stop")
                return
            if len(self.text.token_ids) >= self.params.max_new_tokens or self.context.shape[0] >= self.max_length:
                self.finish("length")
                return

    def fail(self, error: Exception) -> None:
        """This request's own part of a step raised (its drafter, its grammar...): it ends with
        the error, which its caller gets, and its batch mates go on."""
        self.error = error
        self.finish("error")

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.num_generated_tokens = len(self.text.token_ids)
        self.metrics.total_s = time.perf_counter() - self.started
        end = getattr(self.drafter, "end", None)  # see Drafter: what it learns from a whole answer
        if end is not None and reason in ("stop", "length"):
            try:
                end(self.context)
            except Exception:  # the answer is whole and right: a drafter's bookkeeping must not lose it
                logger.exception("the drafter's end() failed after a finished request; its answer stands")

    def room(self) -> int:
        """The most tokens a draft may hold this step: never past the request's length budget."""
        return self.max_length - self.context.shape[0] - 1

    def draft_budget(self) -> int:
        """The most tokens this step may draft: the request's ceiling, within room()."""
        return max(0, min(self.num_draft_tokens, self.room()))
