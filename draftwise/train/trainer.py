"""The training loop for draft heads: AdamW, warmup then cosine, gradient accumulation over
sequences, held-out acceptance measured as it goes, atomic resumable checkpoints. What a head
learns from one sequence is its loss function's business (train/losses.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftwise.train.data import Example

from draftwise.train.losses import LossFunction


@dataclass(frozen=True, slots=True)
class TrainSettings:
    epochs: float = 4.5
    ttt_steps: int = 4  # draft depths trained (EAGLE's training-time test; Medusa: its number of heads)
    learning_rate: float | None = None  # None: default_learning_rate(the head's width)
    warmup_steps: int = 50
    sequences_per_step: int = 4  # sequences an optimizer step learns from
    # Sequences in one forward (padded to the longest); a step's others accumulate gradients.
    # None: all of a step's at once (a GPU's way; on 2 CPU cores 1 and 4 ran alike).
    sequences_per_forward: int | None = 1
    eval_every_s: float = 300.0
    checkpoint_every_s: float = 120.0
    seed: int = 0
    # "bfloat16": the head's products in bfloat16 under autocast, float32 weights and optimizer;
    # "float32": everything in float32; "auto": train_head's choice, bfloat16 on a CPU with AMX
    # tiles (0.89 -> 0.60 s a step of 4 SmolLM2 conversations, Intel Xeon with AMX, 2 threads),
    # float32 elsewhere (bfloat16 autocast ran 1.0 against 0.7 s without AMX's products).
    precision: str = "auto"
    # Train for at most this long (evaluations not counted): after the warmup the schedule is
    # shortened to the steps that fit, at the measured time a step, so the learning rate still
    # decays to its end. None: the full number of epochs.
    max_train_s: float | None = None

    def __post_init__(self) -> None:
        from draftwise.errors import ConfigError

        if self.precision not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"precision={self.precision!r}: use auto, float32 or bfloat16.")
        if self.max_train_s is not None and self.max_train_s <= 0:
            raise ConfigError(f"max_train_s={self.max_train_s}: a time budget must be positive (e.g. --max-minutes 30).")
        if self.epochs <= 0:
            raise ConfigError(f"epochs={self.epochs} must be positive.")
        if self.sequences_per_step < 1 or (self.sequences_per_forward is not None and self.sequences_per_forward < 1):
            raise ConfigError(f"sequences_per_step={self.sequences_per_step}, sequences_per_forward="
                              f"{self.sequences_per_forward}: each must be at least 1 (e.g. --sequences-per-step 4).")


def default_learning_rate(hidden_size: int) -> float:
    """AdamW's peak rate for a head this wide. Measured: SmolLM2's 576-wide heads train well at
    1e-3; a 1536-wide head for Qwen2.5-Coder-1.5B at 1e-3 diverged after ~200 steps (training
    top-1 rose to 0.20, then fell to 0.05 and stayed there) and trained at 2e-4 (0.72 after 5800 steps)."""
    return 1e-3 if hidden_size <= 1024 else 2e-4


def default_precision(device: torch.device) -> str:
    """bfloat16 products where they are fast: a CPU with AMX tiles (where draftwise's kernels are
    built); float32 elsewhere, a GPU included (its products use TF32 there, train_head)."""
    if device.type != "cpu":
        return "float32"
    from draftwise.models.kernels import native_kernels

    kernels = native_kernels(progress=False)
    return "bfloat16" if kernels is not None and kernels.amx_in_hardware() else "float32"


@dataclass(slots=True)
class TrainState:
    step: int = 0
    examples_seen: int = 0
    elapsed_s: float = 0.0  # training time so far, over resumed runs
    curve: list[dict] = field(default_factory=list)  # {"train_s", "step", "mean_accepted_length", ...}
    total_steps: int = 0  # the schedule's length once fitted to max_train_s; 0 = not fitted
    fits: int = 0  # how often it was fitted: after the warmup, then once more from the steps after it
    fit_step: int = 0  # the step and training time of the last fit
    fit_s: float = 0.0
    optimizer: dict | None = None  # AdamW's state when resumed from a checkpoint


def draft_vocabulary(examples: list[Example], size: int, always: list[int]) -> torch.Tensor:
    """The `size` target ids the target writes most often in the answers (plus `always`) -> [size],
    most frequent first (ties by id): any prefix is then the best vocabulary of its size, so a
    drafter may score fewer rows than the head was trained with (EagleDrafter's draft_vocab)."""
    counts = torch.zeros(int(max(int(e.labels.max()) for e in examples)) + 1, dtype=torch.long)
    for example in examples:
        answer_labels = example.labels[example.num_prompt_tokens - 1:]
        counts += torch.bincount(answer_labels, minlength=counts.shape[0])[: counts.shape[0]]
    for token in always:
        if token < counts.shape[0]:
            counts[token] = counts.max() + 1
    ranked = counts.argsort(descending=True, stable=True)
    return ranked[:size]


def train(head: torch.nn.Module, loss_fn: LossFunction, examples: list[Example], settings: TrainSettings,
          state: TrainState, save: Callable[[TrainState, dict], None], evaluate: Callable[[], dict] | None,
          progress: bool = True) -> TrainState:
    """Train in place from `state` (a fresh one, or a checkpoint's); calls save(state, optimizer
    state) every checkpoint_every_s and at the end, evaluate() every eval_every_s."""
    if settings.learning_rate is None:
        raise ValueError("settings.learning_rate is None: resolve it with default_learning_rate(hidden size) first")
    epoch_steps = max(1, math.ceil(settings.epochs * len(examples) / settings.sequences_per_step))
    # A rerun with more epochs trains on; a time budget's fitted length stays with its checkpoint.
    total_steps = epoch_steps if settings.max_train_s is None else state.total_steps or epoch_steps
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.learning_rate,
                                  betas=(0.9, 0.95), weight_decay=0.0)
    if state.optimizer:
        optimizer.load_state_dict(state.optimizer)
        state.optimizer = None

    def learning_rate(step: int) -> float:
        if step < settings.warmup_steps:
            return settings.learning_rate * (step + 1) / settings.warmup_steps
        share = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
        return settings.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, share))))

    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(settings.seed))
    head.train()
    bar = tqdm(total=total_steps, initial=state.step, desc="training head", unit="step", disable=not progress)
    started = time.perf_counter() - state.elapsed_s
    last_checkpoint = last_eval = time.perf_counter()
    step_counts: list[tuple[int, int]] = [(0, 0)] * settings.ttt_steps
    device = next(head.parameters()).device
    precision = default_precision(device) if settings.precision == "auto" else settings.precision
    products = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")  # noqa: E731
    while state.step < total_steps:
        optimizer.zero_grad(set_to_none=True)
        batch = [examples[int(order[(state.examples_seen + i) % len(examples)])] for i in range(settings.sequences_per_step)]
        state.examples_seen += len(batch)
        per_forward = settings.sequences_per_forward or len(batch)
        for first in range(0, len(batch), per_forward):
            part = batch[first:first + per_forward]
            with products():
                loss, counts = loss_fn(part)
            if loss.requires_grad:
                (loss * len(part) / len(batch)).backward()
            step_counts = [(a + c, b + n) for (a, b), (c, n) in zip(step_counts, counts + [(0, 0)] * len(step_counts))]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(state.step)
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        state.step += 1
        state.elapsed_s = time.perf_counter() - started
        bar.update(1)
        if needs_fit(state, settings):
            state.total_steps = total_steps = fitted_steps(state, settings, epoch_steps)
            bar.total = total_steps
            bar.refresh()
        if state.step % 10 == 0:
            bar.set_postfix(acc=" ".join(f"{a / b:.2f}" if b else "-" for a, b in step_counts))
            step_counts = [(0, 0)] * settings.ttt_steps
        now = time.perf_counter()
        done = state.step >= total_steps
        if evaluate is not None and (now - last_eval >= settings.eval_every_s or done):
            head.eval()
            point = {"train_s": round(state.elapsed_s, 1), "step": state.step, **evaluate()}
            head.train()
            state.curve.append(point)
            bar.write(f"after {point['train_s']:.0f} s of training: {point}")
            started += time.perf_counter() - now  # evaluation is not training time
            last_eval = time.perf_counter()
        if now - last_checkpoint >= settings.checkpoint_every_s or done:
            state.elapsed_s = time.perf_counter() - started
            save(state, optimizer.state_dict())
            last_checkpoint = time.perf_counter()
    bar.close()
    head.eval()
    return state


def needs_fit(state: TrainState, settings: TrainSettings) -> bool:
    """Fit after the warmup, then once more when another 10% of the budget has passed: the first
    steps are slow (allocations, caches, a GPU's warm-up), the later ones give the true pace."""
    if settings.max_train_s is None or state.step < settings.warmup_steps:
        return False
    return state.fits == 0 or (state.fits == 1 and state.elapsed_s >= state.fit_s + 0.1 * settings.max_train_s)


def fitted_steps(state: TrainState, settings: TrainSettings, epoch_steps: int) -> int:
    """The schedule's length under settings.max_train_s, at the pace of the steps since the last
    fit (of all steps, at the first); records this fit in state."""
    per_step = (state.elapsed_s - state.fit_s) / max(1, state.step - state.fit_step)
    remaining = max(0.0, settings.max_train_s - state.elapsed_s)
    state.fits, state.fit_step, state.fit_s = state.fits + 1, state.step, state.elapsed_s
    return max(state.step, min(epoch_steps, state.step + int(remaining / max(per_step, 1e-9))))


def save_checkpoint(path: Path, head: torch.nn.Module, state: TrainState, optimizer_state: dict) -> None:
    """Atomically: a crash while writing never loses the previous checkpoint."""
    temporary = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "state": {"step": state.step, "examples_seen": state.examples_seen,
                                                     "elapsed_s": state.elapsed_s, "curve": state.curve,
                                                     "total_steps": state.total_steps, "fits": state.fits,
                                                     "fit_step": state.fit_step, "fit_s": state.fit_s},
                "optimizer": optimizer_state}, temporary)
    temporary.replace(path)


def load_checkpoint(path: Path, head: torch.nn.Module) -> TrainState:
    saved = torch.load(path, weights_only=False)
    head.load_state_dict(saved["head"])
    return TrainState(**saved["state"], optimizer=saved["optimizer"])
