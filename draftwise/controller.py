"""Draft lengths for a whole batch: spend forward rows where they buy the most tokens.

In a batch, one sequence's draft tokens make the forward longer for every sequence in it. So
the controller does not ask "what maximises this request's tokens per second" but "what
maximises the BATCH's committed tokens per second" (the goodput rule of SmartSpec, arXiv
2406.14066), from two things measured online on this machine:

- the seconds of one target forward per number of rows it scores (shared by all requests:
  it is the hardware's; draftwise.draft_length interpolates between measured sizes), and
- each request's own acceptance (its DraftLengthPolicy): the expected tokens each of its draft
  tokens adds, non-increasing along a chain (or a tree's best-first nodes).

A step's fixed part is one row per decoding sequence (each commits at least one token) plus the
prefill rows in it. Draft tokens are ranked by expected gain across all sequences; the step
keeps the n best, for the n that maximises

    (committed tokens without drafts + sum of the n best gains) / seconds charged to decoding

where the seconds charged to decoding are the forward's, forward_seconds(fixed rows + n), less
what the prefill rows add to it (forward_seconds(fixed rows) - forward_seconds(decoding rows)):
the prefill is work the batch owes anyway, so drafts pay their own marginal cost on top of it and
are compared with what the decoding rows commit alone. Counting the prefill's seconds against the
decoding rows' tokens instead made any draft look worth its rows beside a prefill chunk (a step
of 4 sequences and a 128-row chunk commits 4 tokens in a prefill-sized forward), where each
draft row then costs a compute-bound row's full price: on Qwen2.5-1.5B at 4 clients the
controller fell to 0.91-0.93x plain batching.

Because each sequence's gains are non-increasing, the n best are a prefix of each draft. Alone,
this is exactly the single-request rule; as the batch fills, the forward's cost per row rises
(weights are read once per block of rows) and drafts shrink, down to none when drafting cannot
pay. Trimming never changes the output (verification is lossless for any length), only speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.draft_length import DraftLengthPolicy, _cost, _smooth_into
from draftwise.drafters.base import Draft


@dataclass(slots=True)
class Allocation:
    sizes: list[int]  # draft tokens kept per sequence, in the order given
    expected_tokens: float  # expected committed tokens of the step
    num_rows: int  # rows the forward will score


class BatchController:
    def __init__(self, forward_s: dict[int, float] | None = None) -> None:
        # rows scored -> running mean seconds, shared with every policy this controller made
        self.forward_s: dict[int, float] = {} if forward_s is None else forward_s
        # every request's verdicts, pooled: each request's prior (DraftLengthPolicy's pool)
        self.pool = DraftLengthPolicy(forward_s=self.forward_s)

    def new_policy(self) -> DraftLengthPolicy:
        """A request's own acceptance evidence, on the batch's shared forward costs, with the
        batch's pooled acceptance as its prior."""
        return DraftLengthPolicy(forward_s=self.forward_s, pool=self.pool)

    def observe_forward(self, num_rows: int, seconds: float) -> None:
        _smooth_into(self.forward_s, num_rows, seconds)

    def cost(self, num_rows: int) -> float:
        """Seconds of a forward over num_rows rows: measured or interpolated; beyond the largest
        measured size, extended along the measured curve's slope from the largest size at most
        half as big (or the smallest) to the largest. With one size measured: up to twice it as
        cheap as it (optimistic, so bigger forwards get tried and measured), beyond growing with
        the rows.

        Why a slope and not "as cheap as the largest": under load the largest forwards carry a
        128-row prefill chunk, and every row past them costs a compute-bound row's price (3.4 ms
        on Qwen2.5-Coder-1.5B on AMX tiles). Taken as free, drafts rode along every prefill
        step: at 16 clients the controller served 0.90-0.95x plain batching, with a slower time
        to first token."""
        largest = max(self.forward_s)
        if num_rows <= largest:
            return _cost(self.forward_s, num_rows)
        smaller = [n for n in self.forward_s if n <= largest // 2] or [n for n in self.forward_s if n < largest]
        if not smaller:
            if num_rows <= 2 * largest:
                return self.forward_s[largest]
            return self.forward_s[largest] * num_rows / (2 * largest)
        base = max(smaller)
        slope = max(0.0, (self.forward_s[largest] - self.forward_s[base]) / (largest - base))
        return self.forward_s[largest] + slope * (num_rows - largest)

    def allocate(self, drafts: list[tuple[DraftLengthPolicy, Draft]], num_fixed_rows: int,
                 num_fixed_tokens: int, num_prefill_rows: int = 0) -> Allocation:
        """How many tokens of each draft to verify. num_fixed_rows: rows the forward scores
        whatever the drafts (one per decoding sequence, plus prefill rows); num_fixed_tokens:
        tokens the step commits without drafts (one per decoding sequence, plus one per prompt
        whose prefill completes); num_prefill_rows: how many of the fixed rows are prefill (their
        seconds are not charged to the drafts' rate: see the module docstring)."""
        sizes = [0] * len(drafts)
        if not self.forward_s:  # measure a plain step first: every rate is compared with it
            return Allocation(sizes, float(num_fixed_tokens), num_fixed_rows)
        decoding_rows = num_fixed_rows - num_prefill_rows
        fixed_s = self.cost(num_fixed_rows)
        decoding_s = self.cost(decoding_rows) if num_prefill_rows and decoding_rows else None

        def charged(num_draft_rows: int) -> float:  # seconds charged to decoding
            total = self.cost(num_fixed_rows + num_draft_rows) if num_draft_rows else fixed_s
            if decoding_s is None:
                return total
            return decoding_s + max(0.0, total - fixed_s)  # noisy costs may dip: never below the rows'

        ranked = []  # (gain, sequence index)
        for index, (policy, draft) in enumerate(drafts):
            num_tokens = draft.tokens.shape[0]
            if num_tokens:
                scores = draft.scores.tolist() if draft.scores is not None else None
                ranked.extend((gain, index) for gain in policy.expected_gains(draft.key, num_tokens, scores))
        ranked.sort(key=lambda item: -item[0])  # stable: a sequence's equal gains keep their order
        best_n, best_rate = 0, num_fixed_tokens / charged(0)
        expected, best_expected = 0.0, 0.0
        for n, (gain, _) in enumerate(ranked, start=1):
            expected += gain
            rate = (num_fixed_tokens + expected) / charged(n)
            if rate > best_rate:
                best_n, best_rate, best_expected = n, rate, expected
        for _, index in ranked[:best_n]:
            sizes[index] += 1
        return Allocation(sizes, num_fixed_tokens + best_expected, num_fixed_rows + best_n)
