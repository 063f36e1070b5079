"""Many prompts at once, offline: Engine.generate_batch.

The prompts run through draftwise.scheduler's continuous batching on the calling thread, as
`draftwise serve` runs its requests: up to max_batch sequences share each target forward (the
linears read every weight once for all their rows), a finished sequence's slot goes to the next
prompt at the next step, and long prompts prefill in chunks between the others' decode steps.

Every row is computed alike whatever shares its forward (batch invariance), so each greedy
result is, token for token, what Engine.generate gives for that prompt alone. A seeded request
in sampling_mode="coupled" (the default) gives the same text alone or in the batch too; with
sampling_mode="rejection" its text is a draw from the same distribution but not the same draw,
since how many draft tokens each step verifies depends on the batch's load (draftwise.controller).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence as SequenceOf

import torch

from draftwise.config import SamplingParams
from draftwise.errors import ConfigError, DraftwiseError, PromptError
from draftwise.scheduler import DEFAULT_PREFILL_CHUNK, Event, Request, Scheduler, choose_max_batch


class BatchError(DraftwiseError):
    """Some prompts of a batch failed while the others finished: `errors` maps a prompt's index to
    its exception, `results` holds every finished prompt's result (None where it failed)."""

    def __init__(self, errors: dict[int, Exception], results: list) -> None:
        self.errors = errors
        self.results = results
        first = min(errors)
        more = f" (and {len(errors) - 1} more: see .errors)" if len(errors) > 1 else ""
        super().__init__(f"prompt {first} of the batch failed: {errors[first]}{more}; the other prompts' results "
                         "are in .results.")


# The measured batch limit of each target model (scheduler.choose_max_batch), once per model per process.
_MEASURED_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_max_batch(engine, num_prompts: int, verbose: bool = False) -> int:
    """The largest batch this machine's measured forward costs say still pays (as `draftwise
    serve` chooses its --max-batch), at most the number of prompts: measured once per model,
    0.1-2 s (SmolLM2 to Qwen2.5-Coder-1.5B)."""
    if num_prompts <= 1:
        return 1
    model = engine.target.model
    limit = _MEASURED_LIMITS.get(model)
    if limit is None:
        limit = _MEASURED_LIMITS[model] = choose_max_batch(engine, verbose)
    return min(limit, num_prompts)


def generate_batch(engine, prompts: SequenceOf, params: SamplingParams | SequenceOf[SamplingParams],
                   max_batch: int | None = None, progress: bool = False,
                   on_result: Callable[[int, object], None] | None = None) -> list:
    """Engine.generate for every prompt, in one continuous batch: their GenerationResults in the
    prompts' order. params: one SamplingParams for all, or one per prompt. max_batch: the most
    prompts decoded at once (None: from measured costs, default_max_batch). on_result(index,
    result): called as each prompt finishes, in the order they finish (to save a long job's
    answers as they come). A prompt that cannot be encoded raises before anything runs (its
    index in the message); a prompt that fails once running (e.g. too long for the context)
    leaves the others to finish, then raises BatchError with their results."""
    from tqdm.auto import tqdm

    prompts = list(prompts)
    if isinstance(params, SamplingParams):
        params_of = [params] * len(prompts)
    else:
        params_of = list(params)
        if len(params_of) != len(prompts):
            raise ConfigError(f"generate_batch got {len(prompts)} prompts but {len(params_of)} SamplingParams: give "
                              "one for all of them or one per prompt.")
    if max_batch is not None and max_batch < 1:
        raise ConfigError(f"max_batch={max_batch} is invalid: give at least 1 (or None to choose from measured costs).")
    prompt_ids = []
    for index, prompt in enumerate(prompts):
        try:
            prompt_ids.append(engine.encode(prompt))
        except PromptError as error:
            raise PromptError(f"prompt {index} of the batch: {error}") from None
    if not prompts:
        return []
    max_batch = max_batch or default_max_batch(engine, len(prompts))
    results: list = [None] * len(prompts)
    errors: dict[int, Exception] = {}
    scheduler = Scheduler(engine, max_batch, max_queue=len(prompts), prefill_chunk=DEFAULT_PREFILL_CHUNK)
    bar = tqdm(total=len(prompts), unit="prompt", desc="draftwise", disable=not progress)
    started, num_tokens = time.perf_counter(), 0

    def on_event_of(index: int):
        def on_event(event: Event) -> None:  # on this thread, inside scheduler.run()
            nonlocal num_tokens
            if event.error is not None:
                errors[index] = event.error
            elif event.result is not None:
                results[index] = event.result
                num_tokens += len(event.result.token_ids)
                if on_result is not None:
                    on_result(index, event.result)
                bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - started):.1f} tok/s", refresh=False)
            else:
                return
            bar.update(1)
            if len(errors) + sum(result is not None for result in results) == len(prompts):
                scheduler.stop()  # the last one: run() returns at its next loop
        return on_event

    for index, (ids, request_params) in enumerate(zip(prompt_ids, params_of)):
        scheduler.submit(Request(ids, request_params, on_event_of(index)))
    try:
        with torch.no_grad():  # run() turns gradients off on its thread: this one's mode comes back after
            scheduler.run()
    finally:
        bar.close()
    if errors:
        raise BatchError(errors, results)
    return results
