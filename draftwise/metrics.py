"""Speculation statistics of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of them, taken from the prefix cache instead of prefilled
    num_generated_tokens: int = 0  # returned to the user (an ending EOS is not counted)
    num_committed_tokens: int = 0  # chosen by verification, EOS and tokens past a stop included
    num_target_forwards: int = 0  # prefill included: it commits the first token
    num_draft_tokens: int = 0  # proposed
    num_accepted_tokens: int = 0
    # committed as drafts the request's grammar forced (draftwise.structured), not the drafter's:
    # outside num_draft_tokens / num_accepted_tokens, so those stay the drafter's own record
    num_forced_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards after prefill, plus the verifier
    target_forward_s: float = 0.0  # the target forwards alone (part of verify_s)
    total_s: float = 0.0  # prefill through the last token

    def record_step(self, num_proposed: int, num_accepted: int, num_committed: int, depth: int | None = None) -> None:
        """depth: how many positions the draft reached (a chain's length, a tree's depth)."""
        self.num_target_forwards += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_committed_tokens += num_committed
        depth = num_proposed if depth is None else depth
        missing = depth - len(self.proposed_per_position)
        if missing > 0:
            self.proposed_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for position in range(depth):
            self.proposed_per_position[position] += 1
            self.accepted_per_position[position] += position < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward: 1.0 for plain decoding, up to k + 1."""
        return self.num_committed_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Of the drafts that reached position i, the fraction whose token i was accepted."""
        return [accepted / proposed if proposed else 0.0
                for accepted, proposed in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def overhead_vs_forward(self) -> float:
        """Time outside model forwards and drafting (verifier, commit, streaming text) per step,
        as a fraction of one target forward."""
        outside = self.overhead_s + self.verify_s - self.target_forward_s
        return outside / self.target_forward_s if self.target_forward_s else 0.0

    def to_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_committed_tokens": self.num_committed_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "proposed_per_position": list(self.proposed_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "tokens_per_second": self.tokens_per_second,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "target_forward_s": self.target_forward_s,
            "overhead_vs_forward": self.overhead_vs_forward,
            "overhead_s": self.overhead_s,
            "total_s": self.total_s,
        }

    def summary(self) -> str:
        """The one statistics line the CLI prints."""
        return (
            f"{self.num_generated_tokens} tokens in {self.total_s:.2f} s ({self.tokens_per_second:.1f} tok/s) | "
            f"accepted {self.num_accepted_tokens}/{self.num_draft_tokens} drafts "
            f"({100 * self.acceptance_rate:.0f}%) | {self.mean_accepted_length:.2f} tokens/forward | "
            f"draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s, prefill {self.prefill_s:.2f} s"
            + (f" ({self.num_cached_prompt_tokens} of {self.num_prompt_tokens} prompt tokens cached)"
               if self.num_cached_prompt_tokens else "")
        )
