"""Continuous batching: requests join and leave the running batch between steps.

One thread owns the model: `run()` on the calling thread (`draftwise serve` runs it on the
main thread: ATen's OpenMP parallel regions started from any other thread cost about 2x more
here, measured 50 vs 127 us for one small linear, 19 vs 40 ms for a SmolLM2 forward), or
`start()` on a thread of its own (tests, notebooks). Each loop it admits waiting requests up to the batch limit,
runs ONE batched step (draftwise.step) over every running sequence (long prompts enter in
chunks, interleaved with everyone else's decoding, so one long prompt never freezes the other
streams; on AMX tiles all prompts together feed at most the engine's prefill chunk, 512 tokens,
per step: a step of 16 prompts' 128-token chunks was a 2,000-row forward whose 47 MB tensors
glibc maps afresh each time, and Qwen2.5-1.5B's 16-client prefill took 12.7-14.0 s instead of
10.7), then hands each request its new text and retires the finished and the cancelled (a
client that disconnected frees its slot at the next step boundary). Beyond max_queue waiting
requests, submit() refuses at once (the server answers 429 with Retry-After).

Callers on other threads (the server's event loop) receive a request's events through a
callback; the scheduler never blocks on a client.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import fork_drafter
from draftwise.engine import Engine, GenerationResult, new_logprobs, result_of
from draftwise.errors import DraftwiseError
from draftwise.logprobs import TokenLogprob
from draftwise.models.base import Segment, forward_segments
from draftwise.sequence import Sequence
from draftwise.step import StepReport, run_step

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens a sequence feeds per step while others decode
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_TOKENS = 512  # a request's output limit when it sets none (and the context has room)


class QueueFull(DraftwiseError):
    """Too many requests are waiting: retry later."""


@dataclass(slots=True)
class Event:
    delta: str = ""  # text that became final
    num_tokens: int = 0  # tokens committed by the step this delta came from
    result: GenerationResult | None = None  # on the last event of a finished request
    error: Exception | None = None  # the request could not run (bad prompt, shutdown)
    # With logprobs asked for: those of the tokens committed since the previous event (as Engine.stream's updates).
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]  # called on the worker thread: must not block
    num_draft_tokens: int | None = None  # this request's draft ceiling (None: the engine's; 0: off)
    submitted: float = field(default_factory=time.perf_counter)
    sequence: Sequence | None = None
    cancelled: bool = False
    num_logprobs_sent: int = 0


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int, max_queue: int = DEFAULT_MAX_QUEUE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 on_step: Callable[[StepReport, list[Request]], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise DraftwiseError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be at least 1, "
                                 f"max_queue ({max_queue}) at least 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.on_step = on_step
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> "Scheduler":
        """Run the loop on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="draftwise-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    def submit(self, request: Request) -> Request:
        with self._wake:
            if self._stopped:
                raise DraftwiseError("the server is shutting down: retry on another instance.")
            if len(self.waiting) >= self.max_queue and len(self.running) + len(self.waiting) >= self.max_batch:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (limit {self.max_queue}): retry later.")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Drop a request (its client went away): its slot frees at the next step boundary."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    def run(self) -> None:
        """The loop, on the calling thread, until stop()."""
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not self._stopped and not self.waiting and not self.running:
                    self._wake.wait()
                if self._stopped:
                    break
                self._admit()
            self._retire()
            if not self.running:
                continue
            sequences = [request.sequence for request in self.running]
            lengths = [seq.context.shape[0] for seq in sequences]
            try:
                report = run_step(self.engine.target.model, sequences, self.engine.controller,
                                  self.engine.hidden_layers, self.prefill_chunk, self.engine.prefill_chunk)
            except Exception as error:  # a bug must not hang every client: fail this batch loudly
                logger.exception("a batched step failed; its %d requests get an error", len(self.running))
                for request in self.running:
                    request.on_event(Event(error=error))
                    request.sequence.finish("cancelled")
                self._retire()
                continue
            if self.on_step is not None:
                self.on_step(report, list(self.running))
            for request, length in zip(self.running, lengths):
                seq = request.sequence
                delta = "" if seq.finished else seq.text.delta()
                if delta:
                    request.on_event(Event(delta, seq.context.shape[0] - length, logprobs=self._logprobs(request)))
            self._retire()
        for request in list(self.waiting) + self.running:  # shutdown: nobody waits forever
            request.on_event(Event(error=DraftwiseError("the server shut down before the request finished.")))

    def _admit(self) -> None:
        """Move waiting requests into the batch while it has room (the caller holds the lock)."""
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            if request.cancelled:
                continue
            engine = self.engine
            policy = engine.controller.new_policy() if engine.controller is not None else None
            try:
                request.sequence = engine.start(request.prompt_ids, request.params, fork_drafter(engine.drafter), policy,
                                                request.num_draft_tokens)
            except Exception as error:  # this request's error, never the loop's: others keep being served
                if not isinstance(error, DraftwiseError):
                    logger.exception("starting a request failed; it gets an error")
                request.on_event(Event(error=error))
                continue
            self.running.append(request)

    @staticmethod
    def _logprobs(request: Request) -> list[TokenLogprob]:
        """The request's logprobs not yet sent, marked sent."""
        entries = new_logprobs(request.sequence, request.num_logprobs_sent)
        request.num_logprobs_sent += len(entries)
        return entries

    def _retire(self) -> None:
        """Finished requests get their result; cancelled ones just leave."""
        still = []
        for request in self.running:
            seq = request.sequence
            if request.cancelled and not seq.finished:
                seq.finish("cancelled")
            if seq.finished:
                self.engine.finish(seq)
                if seq.error is not None:  # its own part of a step failed; its batch mates went on
                    logger.error("a request failed alone: %r", seq.error, exc_info=seq.error)
                    request.on_event(Event(error=seq.error))
                elif seq.finish_reason != "cancelled":
                    request.on_event(Event(seq.text.delta(final=True), 0, result_of(seq), logprobs=self._logprobs(request)))
                if self.on_finish is not None:
                    self.on_finish(request)
            else:
                still.append(request)
        self.running = still


# Grow the batch while doubling it still adds this much throughput (tokens per second).
MIN_DOUBLING_GAIN = 1.15
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def measure_batch_costs(model, sizes: tuple[int, ...] = BATCH_SIZES, repeats: int = 3) -> dict[int, float]:
    """Seconds of one plain decoding forward over N sequences (one row each), best of
    `repeats`: the cost curve the batch limit and the controller start from."""
    costs = {}
    for size in sizes:
        caches = [model.new_cache(2) for _ in range(size)]
        best = float("inf")
        for _ in range(repeats):
            segments = [Segment(torch.tensor([index % 100 + 10]), torch.zeros(1, dtype=torch.long), cache)
                        for index, cache in enumerate(caches)]
            tic = time.perf_counter()
            forward_segments(model, segments)
            best = min(best, time.perf_counter() - tic)
            for cache in caches:
                cache.truncate(0)
        costs[size] = best
    return costs


def choose_max_batch(engine: Engine, verbose: bool = True) -> int:
    """The batch limit from this machine's measured forward costs (max_batch_from_costs), the
    curve said on stderr where verbose: `draftwise serve`'s and `draftwise batch`'s default."""
    costs = measure_batch_costs(engine.target.model)
    best = max_batch_from_costs(costs)
    if verbose:
        curve = ", ".join(f"{size}: {1000 * seconds:.0f} ms" for size, seconds in costs.items())
        print(f"draftwise: one decoding forward per batch size: {curve} -> --max-batch {best}", file=sys.stderr)
    return best


def max_batch_from_costs(costs: dict[int, float]) -> int:
    """The largest measured batch whose throughput beats half its size by MIN_DOUBLING_GAIN:
    past it, more sequences per forward mostly add latency."""
    sizes = sorted(costs)
    best = sizes[0]
    for smaller, larger in zip(sizes, sizes[1:]):
        if (larger / costs[larger]) < MIN_DOUBLING_GAIN * (smaller / costs[smaller]):
            break
        best = larger
    return best
