"""How many draft tokens to verify each step, chosen from what this machine measured.

Verifying m draft tokens costs one target forward over 1 + m tokens, and that cost depends on
the hardware and the weight format far more than intuition says. Measured here for
Qwen2.5-Coder-1.5B (one forward over 1 + m tokens, relative to one token):

    float32:        m=1 1.69x   m=5 1.86x   m=10 2.10x   (any draft costs ~1.7x: be picky)
    bfloat16 (AMX): m=5 1.04x   m=10 1.05x                (drafts are free: always draft long)
    int4:           m=5 2.26x   m=10 3.39x                (every token costs: draft short)

No fixed k suits all three, so the engine measures. This policy keeps a request's evidence:
per kind of draft (the drafter's `key`, e.g. the n-gram match length) the acceptance rate at
each draft position, and the seconds of a target forward per number of tokens scored (shared
across a batch's requests: they are the machine's). Each step draftwise.controller turns that
into the m draft tokens worth verifying; alone, the m that maximises expected committed tokens
per second:

    (1 + sum_{i<=m} prod_{j<=i} accept_j) / forward_seconds(1 + m)

Trimming a draft never changes the output (verification is lossless for any m), only speed.
A draft MODEL pays a forward per draft token, so for it (a drafter with `sequential = True`)
the engine asks before drafting (`choose_before_drafting`) and the cost of drafting m tokens,
also measured, joins the denominator; when that says "draft nothing", a one-token draft is
still tried every PROBE_INTERVAL steps, so the acceptance estimate can recover.
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
PROBE_INTERVAL = 16  # steps without drafting before a sequential drafter is tried again
# Share of acceptance evidence a new request inherits: how well drafts do depends on the text
# (a draft model that failed on a chat can shine on a code edit), so each request re-learns
# quickly, while forward costs (the hardware's) carry over whole.
REQUEST_MEMORY = 0.1


class DraftLengthPolicy:
    def __init__(self, forward_s: dict[int, float] | None = None, pool: "DraftLengthPolicy | None" = None) -> None:
        """forward_s: a forward-cost table to share (the batch's, draftwise.controller); the
        costs are the machine's, the acceptance evidence this policy's own. pool: a policy that
        also receives every chain verdict of this one (observe_verdict; and of its siblings: the
        batch controller's), whose acceptance is this one's prior instead of PRIOR_ACCEPTANCE (a
        tree's calibration stays per request): a request that joins a batch
        starts from what the batch's drafts of the same kind have been doing lately."""
        self.pool = pool
        # tokens scored -> running mean seconds
        self.forward_s: dict[int, float] = {} if forward_s is None else forward_s
        self.draft_s: dict[int, float] = {}  # tokens drafted -> running mean seconds (sequential drafters)
        self.steps_without_draft = 0
        # key -> per draft position [accepted weight, reached weight]
        self.acceptance: dict[Hashable, list[list[float]]] = {}
        self.tree_calibration: dict[Hashable, list[float]] = {}  # key -> [accepted, predicted] decayed sums

    def begin_request(self) -> None:
        """A new request starts: keep only REQUEST_MEMORY of the acceptance evidence."""
        for positions in self.acceptance.values():
            for counts in positions:
                counts[0] *= REQUEST_MEMORY
                counts[1] *= REQUEST_MEMORY
        for sums in self.tree_calibration.values():
            sums[0] *= REQUEST_MEMORY
            sums[1] *= REQUEST_MEMORY
        self.steps_without_draft = 0

    def choose_before_drafting(self, num_available: int) -> int:
        """How many tokens a sequential drafter should draft at all (0 = a plain step)."""
        best = self._best(None, num_available, include_draft_cost=True)
        if best == 0 and num_available and 1 in self.forward_s:
            self.steps_without_draft += 1
            if self.steps_without_draft >= PROBE_INTERVAL:
                best = 1  # a cheap probe: acceptance may have changed with the text
        if best:
            self.steps_without_draft = 0
        return best

    def _best(self, key: Hashable, num_available: int, include_draft_cost: bool) -> int:
        if num_available == 0 or 1 not in self.forward_s:
            return 0  # measure a plain step first: every rate is compared with it
        best, best_rate = 0, 1.0 / self.forward_s[1]
        expected, survive = 1.0, 1.0
        for m in range(1, num_available + 1):
            survive *= self._acceptance(key, m - 1)
            expected += survive
            seconds = _cost(self.forward_s, m + 1) + (_cost(self.draft_s, m) if include_draft_cost and self.draft_s else 0.0)
            rate = expected / seconds
            if rate > best_rate:
                best, best_rate = m, rate
        return best

    def expected_gains(self, key: Hashable, num_tokens: int, scores: list[float] | None) -> list[float]:
        """Expected tokens each draft token adds to the step's output, non-increasing: for a
        chain, the chance that it and every earlier one are accepted; for a scored tree (best
        first), its calibrated score. The batch controller spends forward rows on the best."""
        if scores is not None:
            calibration = self._calibration(key)
            return [calibration * score for score in scores]
        gains, survive = [], 1.0
        for position in range(num_tokens):
            survive *= self._acceptance(key, position)
            gains.append(survive)
        return gains

    def observe_tree_verdict(self, key: Hashable, predicted: float, num_accepted: int) -> None:
        """A verified tree whose scores summed to `predicted` had num_accepted nodes accepted."""
        sums = self.tree_calibration.setdefault(key, [0.0, 0.0])
        sums[0] = DECAY * sums[0] + num_accepted
        sums[1] = DECAY * sums[1] + predicted

    def _calibration(self, key: Hashable) -> float:
        accepted, predicted = self.tree_calibration.get(key, (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT) / (predicted + PRIOR_WEIGHT)  # prior: the scores are calibrated

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        _smooth_into(self.forward_s, num_tokens, seconds)

    def observe_draft(self, num_tokens: int, seconds: float) -> None:
        """A sequential drafter took `seconds` to draft num_tokens tokens."""
        _smooth_into(self.draft_s, num_tokens, seconds)

    def observe_verdict(self, key: Hashable, num_proposed: int, num_accepted: int) -> None:
        """Positions 0 .. num_accepted (the first rejected one included) were reached."""
        positions = self.acceptance.setdefault(key, [])
        for position in range(min(num_proposed, num_accepted + 1)):
            if position == len(positions):
                positions.append([0.0, 0.0])
            counts = positions[position]
            counts[0] = DECAY * counts[0] + (position < num_accepted)
            counts[1] = DECAY * counts[1] + 1.0
        if self.pool is not None:
            self.pool.observe_verdict(key, num_proposed, num_accepted)

    def _acceptance(self, key: Hashable, position: int) -> float:
        positions = self.acceptance.get(key, [])
        accepted, reached = positions[position] if position < len(positions) else (0.0, 0.0)
        prior = PRIOR_ACCEPTANCE if self.pool is None else self.pool._acceptance(key, position)
        return (accepted + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)


def _smooth_into(costs: dict[int, float], size: int, seconds: float) -> None:
    previous = costs.get(size)
    costs[size] = seconds if previous is None else (1 - COST_SMOOTHING) * previous + COST_SMOOTHING * seconds


def _cost(costs: dict[int, float], size: int) -> float:
    """Measured, else interpolated between measured neighbours, else (beyond the largest
    measured size) as cheap as the largest: optimistic, so it gets tried. Below the smallest
    measured size: scaled down from it."""
    if size in costs:
        return costs[size]
    below = [n for n in costs if n < size]
    above = [n for n in costs if n > size]
    if not below:
        smallest = min(above)
        return costs[smallest] * size / smallest
    lower = max(below)
    if not above:
        return costs[lower]
    upper = min(above)
    share = (size - lower) / (upper - lower)
    return (1 - share) * costs[lower] + share * costs[upper]
