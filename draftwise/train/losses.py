"""What a draft head learns from a batch of recorded sequences: a loss and, per draft depth, how
many of its predictions were the target's own choice (the progress bar shows those accuracies).

Labels are the target's argmax after each position (data.Example.labels), mapped to the head's
draft vocabulary; only positions inside the answer count (the head drafts answers, never the
user's prompt); a label outside the draft vocabulary is ignored. A batch's sequences are padded
at the end to the longest: a padded row sees only rows before it and its labels are ignored, so
each sequence's rows compute what they compute alone, and the loss is the mean over the batch's
counted positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftwise.heads.eagle import EagleHead
from draftwise.heads.medusa import MedusaHeads
from draftwise.train.data import Example

IGNORE = -100
STEP_DECAY = 0.8  # weight of depth j: STEP_DECAY ** (j - 1); deep guesses matter less (they are reached less)
# Under autocast (TrainSettings.precision "bfloat16") a batch's rows are padded to a multiple of
# this, and so are the rows sent through the LM head: oneDNN builds a kernel for every new matrix
# shape (about 1 ms each, measured: a bfloat16 product of 150-189 rows ran 1.6 ms a call with the
# row count changing every call, 0.54 ms with it fixed), and conversations come in every length.
ROW_BUCKET = 16
LossFunction = Callable[[list[Example]], tuple[torch.Tensor, list[tuple[int, int]]]]


@dataclass(frozen=True, slots=True)
class Padded:
    """Examples padded at the end to the longest: tokens, labels [B, L]; features [B, L, F]."""
    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor  # [B]
    num_prompt_tokens: torch.Tensor  # [B]


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def pad(examples: list[Example], device: torch.device, multiple: int = 1) -> Padded:
    """Padded at the end to the longest, rounded up to a multiple of `multiple`."""
    longest = _round_up(max(e.tokens.shape[0] for e in examples), multiple)

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].new_zeros(len(tensors), longest, *tensors[0].shape[1:])
        for row, tensor in enumerate(tensors):
            out[row, : tensor.shape[0]] = tensor
        return out.to(device, non_blocking=True)

    return Padded(stacked([e.tokens for e in examples]), stacked([e.features for e in examples]),
                  stacked([e.labels for e in examples]),
                  torch.tensor([e.tokens.shape[0] for e in examples], device=device),
                  torch.tensor([e.num_prompt_tokens for e in examples], device=device))


def target_to_draft(draft_to_target: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[target vocab] -> draft id, IGNORE for tokens outside the draft vocabulary."""
    table = torch.full((target_vocab_size,), IGNORE, dtype=torch.long, device=draft_to_target.device)
    table[draft_to_target] = torch.arange(draft_to_target.shape[0], device=draft_to_target.device)
    return table


def _score(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, int]]:
    counted = int((target != IGNORE).sum())
    if not counted:
        return None, (0, 0)
    correct = int(((logits.argmax(-1) == target) & (target != IGNORE)).sum())
    return F.cross_entropy(logits, target, ignore_index=IGNORE), (correct, counted)


def _bucketed() -> int:
    """Rows per bucket for this call's products: ROW_BUCKET under autocast, else 1 (none)."""
    return ROW_BUCKET if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda") else 1


class _Logits:
    """head.logits(rows), with the rows padded to a multiple of `bucket` (dropped again after) and,
    under autocast, the LM head's frozen weight cast once: autocast caches its casts only of weights
    that learn, and casting the 8192 x 576 rows each call cost 5.5 ms (AMX Xeon)."""

    def __init__(self, head) -> None:
        self.head = head
        self.cast: torch.Tensor | None = None

    def __call__(self, rows: torch.Tensor, bucket: int) -> torch.Tensor:
        count = rows.shape[0]
        padded = _round_up(count, bucket)
        if padded > count:
            rows = torch.cat((rows, rows.new_zeros(padded - count, rows.shape[1])))
        weight = self.head.lm_head.weight
        dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else None
        if dtype is None or weight.requires_grad:
            return self.head.logits(rows)[:count]
        if self.cast is None or self.cast.dtype != dtype:
            self.cast = weight.detach().to(dtype)
        # head.logits' formula: the final norm, then the LM head's rows
        return F.linear(self.head.norm(rows).to(dtype), self.cast)[:count]


def _answer_targets(batch: Padded, table: torch.Tensor, first_row_offset: int, rows: int) -> torch.Tensor:
    """Draft-vocabulary labels [B, rows] at positions offset..offset+rows-1, IGNORE outside the
    answer and past each sequence's end."""
    target = table[batch.labels[:, first_row_offset:first_row_offset + rows]]
    position = torch.arange(rows, device=target.device) + first_row_offset
    # Position t's label is token t + 1: it belongs to the answer when t + 1 >= num_prompt_tokens.
    keep = (position[None] + 1 >= batch.num_prompt_tokens[:, None]) & (position[None] < batch.lengths[:, None])
    return torch.where(keep, target, torch.full_like(target, IGNORE))


def eagle_loss(head: EagleHead, embed: torch.Tensor, ttt_steps: int) -> LossFunction:
    """EAGLE-3's training-time test (Li et al., 2025). At inference the head's rows over committed
    context read the target's features, but deeper draft nodes read the head's own previous
    output. Training does the same: step 1 runs every row r on the target's feature of position
    r and token r + 1; step j > 1 feeds row r the output of step j - 1 at row r and token r + j,
    and lets it attend to step 1's rows up to r (the committed context) and to its own rows of
    steps 2..j (its draft ancestors): exactly the keys a depth-j node sees in drafters/eagle.py.
    Row r of step j predicts the target's label at position r + j.
    embed: the target's token embeddings [target vocab, hidden], on the head's device (the
    example's tensors move there)."""

    logits = _Logits(head)

    def loss_fn(examples: list[Example]):
        table = target_to_draft(head.draft_to_target, embed.shape[0])  # read now: the vocabulary may be set later
        bucket = _bucketed()
        batch = pad(examples, embed.device, bucket)
        tokens = batch.tokens
        length = tokens.shape[1]
        device = tokens.device
        feature = head.fuse_features(batch.features)[:, :-1]  # row r: the target's feature of position r
        keys, values, counts = [], [], []
        total = torch.zeros((), device=device)
        for step in range(1, ttt_steps + 1):
            rows = length - step
            if rows <= 0:
                break
            x, q, k, v = head.project(feature[:, :rows], embed[tokens[:, step:step + rows]],
                                      torch.arange(rows, device=device) + step)
            keys.append(k)
            values.append(v)
            causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
            diagonal = torch.eye(rows, dtype=torch.bool, device=device)
            mask = torch.cat([causal] + [diagonal] * (step - 1), dim=1)  # [rows, step * rows]
            outputs = head.finish(x, q, torch.cat([key[:, :rows] for key in keys], dim=1),
                                  torch.cat([value[:, :rows] for value in values], dim=1), mask)
            # Only the answer's positions are scored: the prompt's (a third of SmolLM2's tokens) skip
            # the draft vocabulary's LM head, the step's largest product.
            target = _answer_targets(batch, table, step, rows).flatten()
            scored = target != IGNORE
            loss, count = _score(logits(outputs.flatten(0, 1)[scored], bucket), target[scored])
            if loss is not None:
                total = total + STEP_DECAY ** (step - 1) * loss
            counts.append(count)
            feature = outputs
        return total, counts

    return loss_fn


def medusa_loss(heads: MedusaHeads, target_vocab_size: int) -> LossFunction:
    """Medusa-1 (Cai et al., 2024): head k reads the final hidden state of position r and
    predicts the target's label at position r + k (the token k + 1 ahead)."""

    def loss_fn(examples: list[Example]):
        table = target_to_draft(heads.draft_to_target, target_vocab_size)
        batch = pad(examples, heads.draft_to_target.device, _bucketed())
        hidden = batch.features.float()  # [B, L, hidden]: the final norm's output
        length = hidden.shape[1]
        total = torch.zeros((), device=hidden.device)
        counts = []
        logits = heads(hidden)  # [heads, B, L, draft vocab]
        for k in range(1, heads.config.num_heads + 1):
            rows = length - k
            if rows <= 0:
                break
            loss, count = _score(logits[k - 1, :, :rows].flatten(0, 1), _answer_targets(batch, table, k, rows).flatten())
            if loss is not None:
                total = total + STEP_DECAY ** (k - 1) * loss
            counts.append(count)
        return total, counts

    return loss_fn
