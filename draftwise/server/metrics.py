"""The server's Prometheus metrics (GET /metrics): load, tokens, speculation, latency.

Each app gets its own registry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from draftwise.metrics import RequestMetrics
from draftwise.step import StepReport

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_POSITIONS = 32  # per-position acceptance is reported for the first positions only


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("draftwise_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("draftwise_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("draftwise_generated_tokens", "tokens returned to clients", registry=r)
        self.cached_prompt_tokens = Counter("draftwise_cached_prompt_tokens",
                                            "prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.prefix_cache_bytes = Gauge("draftwise_prefix_cache_bytes", "what the prefix cache holds", registry=r)
        self.queue_depth = Gauge("draftwise_queue_depth", "requests waiting for a batch slot", registry=r)
        self.batch_size = Gauge("draftwise_batch_size", "sequences in the running batch", registry=r)
        self.max_batch = Gauge("draftwise_max_batch", "the batch limit", registry=r)
        self.cancelled = Counter("draftwise_cancelled_requests", "requests dropped (client gone, timeout)", registry=r)
        self.draft_tokens = Counter("draftwise_draft_tokens", "draft tokens verified", registry=r)
        self.accepted_tokens = Counter("draftwise_accepted_tokens", "draft tokens accepted", registry=r)
        self.target_forwards = Counter("draftwise_target_forwards", "target forwards, per sequence", registry=r)
        self.committed_tokens = Counter("draftwise_committed_tokens", "tokens committed by verification", registry=r)
        self.acceptance_rate = Gauge("draftwise_acceptance_rate", "accepted / verified draft tokens, all time", registry=r)
        self.mean_accepted_length = Gauge("draftwise_mean_accepted_length",
                                          "committed tokens per target forward per sequence, all time", registry=r)
        self.position_proposed = Counter("draftwise_position_proposed", "drafts reaching a position",
                                         ["position"], registry=r)
        self.position_accepted = Counter("draftwise_position_accepted", "drafts whose token at a position was accepted",
                                         ["position"], registry=r)
        self.position_acceptance = Gauge("draftwise_position_acceptance", "acceptance rate per draft position",
                                         ["position"], registry=r)
        self.draft_tokens_chosen = Histogram("draftwise_draft_tokens_chosen",
                                             "draft tokens the controller kept per sequence per step",
                                             buckets=DRAFT_BUCKETS, registry=r)
        self.step_rows = Histogram("draftwise_step_rows", "rows scored per batched forward",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.step_seconds = Histogram("draftwise_step_seconds", "seconds per batched target forward",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("draftwise_time_to_first_token_seconds", "request arrival to first text",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("draftwise_inter_token_latency_seconds",
                                             "seconds between a stream's tokens", buckets=LATENCY_BUCKETS, registry=r)
        self._positions = [[0, 0] for _ in range(MAX_POSITIONS)]  # [proposed, accepted]
        self._totals = {"drafted": 0, "accepted": 0, "forwards": 0, "committed": 0}

    def observe_step(self, report: StepReport) -> None:
        self.step_rows.observe(report.num_rows)
        self.step_seconds.observe(report.forward_s)
        for chosen in report.draft_tokens_chosen:
            self.draft_tokens_chosen.observe(chosen)

    def observe_finished(self, metrics: RequestMetrics) -> None:
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.cached_prompt_tokens.inc(metrics.num_cached_prompt_tokens)
        self.generated_tokens.inc(metrics.num_generated_tokens)
        self.draft_tokens.inc(metrics.num_draft_tokens)
        self.accepted_tokens.inc(metrics.num_accepted_tokens)
        self.target_forwards.inc(metrics.num_target_forwards)
        self.committed_tokens.inc(metrics.num_committed_tokens)
        totals = self._totals
        for name, value in (("drafted", metrics.num_draft_tokens), ("accepted", metrics.num_accepted_tokens),
                            ("forwards", metrics.num_target_forwards), ("committed", metrics.num_committed_tokens)):
            totals[name] += value
        self.acceptance_rate.set(totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0)
        self.mean_accepted_length.set(totals["committed"] / totals["forwards"] if totals["forwards"] else 0.0)
        for position, (proposed, accepted) in enumerate(zip(metrics.proposed_per_position[:MAX_POSITIONS],
                                                             metrics.accepted_per_position)):
            label = str(position)
            self.position_proposed.labels(label).inc(proposed)
            self.position_accepted.labels(label).inc(accepted)
            totals = self._positions[position]
            totals[0] += proposed
            totals[1] += accepted
            self.position_acceptance.labels(label).set(totals[1] / totals[0] if totals[0] else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
