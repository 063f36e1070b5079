"""What a draft head learns from one recorded sequence: a loss and, per draft depth, how many
of its predictions were the target's own choice (the progress bar shows those accuracies).

Labels are the target's argmax after each position (data.Example.labels), mapped to the head's
draft vocabulary; only positions inside the answer count (the head drafts answers, never the
user's prompt); a label outside the draft vocabulary is ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from draftwise.heads.eagle import EagleHead
from draftwise.heads.medusa import MedusaHeads
from draftwise.train.data import Example

IGNORE = -100
STEP_DECAY = 0.8  # weight of depth j: STEP_DECAY ** (j - 1); deep guesses matter less (they are reached less)
LossFunction = Callable[[Example], tuple[torch.Tensor, list[tuple[int, int]]]]


def target_to_draft(draft_to_target: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[target vocab] -> draft id, IGNORE for tokens outside the draft vocabulary."""
    table = torch.full((target_vocab_size,), IGNORE, dtype=torch.long, device=draft_to_target.device)
    table[draft_to_target] = torch.arange(draft_to_target.shape[0], device=draft_to_target.device)
    return table


def on_device(example: Example, device: torch.device) -> Example:
    """The example with its tensors on the device training runs on (itself when already there)."""
    if example.tokens.device == device:
        return example
    return replace(example, tokens=example.tokens.to(device), features=example.features.to(device),
                   labels=example.labels.to(device))


def _score(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, int]]:
    counted = int((target != IGNORE).sum())
    if not counted:
        return None, (0, 0)
    correct = int(((logits.argmax(-1) == target) & (target != IGNORE)).sum())
    return F.cross_entropy(logits, target, ignore_index=IGNORE), (correct, counted)


def _answer_targets(example: Example, table: torch.Tensor, first_row_offset: int, rows: int) -> torch.Tensor:
    """Draft-vocabulary labels at positions offset..offset+rows-1, IGNORE outside the answer."""
    target = table[example.labels[first_row_offset:first_row_offset + rows]]
    # Position t's label is token t + 1: it belongs to the answer when t + 1 >= num_prompt_tokens.
    answer = torch.arange(rows, device=target.device) + first_row_offset + 1 >= example.num_prompt_tokens
    return torch.where(answer, target, torch.full_like(target, IGNORE))


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

    def loss_fn(example: Example):
        table = target_to_draft(head.draft_to_target, embed.shape[0])  # read now: the vocabulary may be set later
        example = on_device(example, embed.device)
        tokens = example.tokens
        length = tokens.shape[0]
        device = tokens.device
        feature = head.fuse_features(example.features)[:-1]  # row r: the target's feature of position r
        keys, values, counts = [], [], []
        total = torch.zeros((), device=device)
        for step in range(1, ttt_steps + 1):
            rows = length - step
            if rows <= 0:
                break
            x, q, k, v = head.project(feature[:rows], embed[tokens[step:step + rows]],
                                      torch.arange(rows, device=device) + step)
            keys.append(k)
            values.append(v)
            causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
            diagonal = torch.eye(rows, dtype=torch.bool, device=device)
            mask = torch.cat([causal] + [diagonal] * (step - 1), dim=1)  # [rows, step * rows]
            outputs = head.finish(x, q, torch.cat([key[:rows] for key in keys]),
                                  torch.cat([value[:rows] for value in values]), mask)
            loss, count = _score(head.logits(outputs), _answer_targets(example, table, step, rows))
            if loss is not None:
                total = total + STEP_DECAY ** (step - 1) * loss
            counts.append(count)
            feature = outputs
        return total, counts

    return loss_fn


def medusa_loss(heads: MedusaHeads, target_vocab_size: int) -> LossFunction:
    """Medusa-1 (Cai et al., 2024): head k reads the final hidden state of position r and
    predicts the target's label at position r + k (the token k + 1 ahead)."""

    def loss_fn(example: Example):
        table = target_to_draft(heads.draft_to_target, target_vocab_size)
        example = on_device(example, heads.draft_to_target.device)
        hidden = example.features.float()  # [T, hidden]: the final norm's output
        length = hidden.shape[0]
        total = torch.zeros((), device=hidden.device)
        counts = []
        logits = heads(hidden)  # [heads, T, draft vocab]
        for k in range(1, heads.config.num_heads + 1):
            rows = length - k
            if rows <= 0:
                break
            loss, count = _score(logits[k - 1, :rows], _answer_targets(example, table, k, rows))
            if loss is not None:
                total = total + STEP_DECAY ** (k - 1) * loss
            counts.append(count)
        return total, counts

    return loss_fn
