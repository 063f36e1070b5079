"""How many draft tokens to verify each step, chosen from what this machine measured.

Verifying m draft tokens costs one target forward over 1 + m tokens, and that cost depends on
the hardware and the weight format far more than intuition says. Measured here for
Qwen2.5-Coder-1.5B (one forward over 1 + m tokens, relative to one token):

    float32:        m=1 1.69x   m=5 1.86x   m=10 2.10x   (any draft costs ~1.7x: be picky)
    bfloat16 (AMX): m=5 1.04x   m=10 1.05x                (drafts are free: always draft long)
    int4:           m=5 2.26x   m=10 3.39x                (every token costs: draft short)

No fixed k suits all three, so the engine asks this policy. It keeps the measured seconds of a
target forward per number of tokens scored, and, per kind of draft (the drafter's `key`, e.g.
the n-gram match length), the acceptance rate at each draft position. Each step it keeps the
m draft tokens that maximise expected committed tokens per second:

    (1 + sum_{i<=m} prod_{j<=i} accept_j) / forward_seconds(1 + m)

Trimming a draft never changes the output (verification is lossless for any m), only speed.
It measures a plain step first; a size it has not measured is interpolated between measured
neighbours, or taken as cheap as the largest measured one (so longer drafts get tried);
acceptance starts at an optimistic prior and decays towards recent behaviour.
"""

from __future__ import annotations

from collections.abc import Hashable

PRIOR_ACCEPTANCE = 0.7  # optimistic start, so every kind of draft gets tried
PRIOR_WEIGHT = 2.0  # in observations
DECAY = 0.95  # per observation: acceptance follows the text as it changes
COST_SMOOTHING = 0.3  # weight of a new forward time in its running mean


class DraftLengthPolicy:
    def __init__(self) -> None:
        self.forward_s: dict[int, float] = {}  # tokens scored -> running mean seconds
        # key -> per draft position [accepted weight, reached weight]
        self.acceptance: dict[Hashable, list[list[float]]] = {}

    def choose(self, key: Hashable, num_available: int) -> int:
        """How many of num_available draft tokens of this kind to verify (0 = none)."""
        if num_available == 0 or 1 not in self.forward_s:
            return 0  # measure a plain step first: every rate is compared with it
        best, best_rate = 0, 1.0 / self.forward_s[1]
        expected, survive = 1.0, 1.0
        for m in range(1, num_available + 1):
            survive *= self._acceptance(key, m - 1)
            expected += survive
            rate = expected / self._forward_cost(m + 1)
            if rate > best_rate:
                best, best_rate = m, rate
        return best

    def _forward_cost(self, num_tokens: int) -> float:
        """Measured, else interpolated between measured neighbours, else (beyond the largest
        measured size) as cheap as the largest: optimistic, so it gets tried."""
        if num_tokens in self.forward_s:
            return self.forward_s[num_tokens]
        below = max(n for n in self.forward_s if n < num_tokens)  # 1 is always measured here
        above = [n for n in self.forward_s if n > num_tokens]
        if not above:
            return self.forward_s[below]
        upper = min(above)
        share = (num_tokens - below) / (upper - below)
        return (1 - share) * self.forward_s[below] + share * self.forward_s[upper]

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        previous = self.forward_s.get(num_tokens)
        self.forward_s[num_tokens] = seconds if previous is None else (
            (1 - COST_SMOOTHING) * previous + COST_SMOOTHING * seconds)

    def observe_verdict(self, key: Hashable, num_proposed: int, num_accepted: int) -> None:
        """Positions 0 .. num_accepted (the first rejected one included) were reached."""
        positions = self.acceptance.setdefault(key, [])
        for position in range(min(num_proposed, num_accepted + 1)):
            if position == len(positions):
                positions.append([0.0, 0.0])
            counts = positions[position]
            counts[0] = DECAY * counts[0] + (position < num_accepted)
            counts[1] = DECAY * counts[1] + 1.0

    def _acceptance(self, key: Hashable, position: int) -> float:
        positions = self.acceptance.get(key, [])
        accepted, reached = positions[position] if position < len(positions) else (0.0, 0.0)
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)
