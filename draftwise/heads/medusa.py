"""Medusa heads: a few residual blocks on one of the target's hidden states, one per future token.

Medusa (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", ICML 2024): the target's own LM head predicts the next token; head k predicts the token
k + 1 positions ahead from the same hidden state, as h + SiLU(W_k h) through a shared LM head
over the reduced draft vocabulary (the target's own LM head rows, frozen). The heads' top
candidates are combined into a tree (drafters/medusa.py). Cheaper than EAGLE (no attention, one
matrix per head) but blind to the path: head 2 does not know which token head 1 chose.
Unlike Medusa's last hidden state, h is the RMS-normed residual stream of the high layer the
EAGLE head also fuses (layer 26 of SmolLM2's 30), so one recording of the target's hidden
states trains both kinds of head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.heads.eagle import RMSNorm, fill_lm_head, read_head_files, save_head

FORMAT_VERSION = 1


@dataclass(frozen=True)
class MedusaConfig:
    target: str
    hidden_size: int
    num_heads: int  # head k = 1..num_heads predicts the token k + 1 positions after the hidden state's
    hidden_layers: tuple[int, ...]  # (layer,): the target layer whose output the heads read
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    kind: str = "medusa"
    format_version: int = FORMAT_VERSION
    lm_head_from_target: bool = True  # the target's own rows, frozen: not stored (see heads/eagle.py)
    weight_storage: str = "q8_0"  # matrices in Q8_0 blocks or "bf16" (see heads/eagle.py)
    training: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_layers", tuple(self.hidden_layers))

    @classmethod
    def for_target(cls, target_model, target_name: str, draft_vocab_size: int, num_heads: int = 4) -> "MedusaConfig":
        from draftwise.heads.eagle import EagleConfig

        s = target_model.shape
        high = EagleConfig.for_target(target_model, target_name, draft_vocab_size).hidden_layers[-1]
        return cls(target=target_name, hidden_size=s.hidden_size, num_heads=num_heads, hidden_layers=(high,),
                   draft_vocab_size=draft_vocab_size, target_vocab_size=s.vocab_size, rms_norm_eps=s.rms_norm_eps)


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(config.num_heads))
        for block in self.blocks:  # zero: every head starts as the target's own next-token guess
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [num_heads, ..., draft vocab]. Every head's input goes
        through the shared LM head in one product (its weights read once, not once per head)."""
        hidden = self.norm(hidden.float())
        inputs = torch.stack([hidden + F.silu(block(hidden)) for block in self.blocks])  # [num_heads, ..., hidden]
        return self.lm_head(inputs.flatten(0, -2)).view(*inputs.shape[:-1], -1)

    def save(self, folder: str | Path) -> Path:
        return save_head(self, folder)


def load_medusa(folder: str | Path, target_model) -> MedusaHeads:
    """Heads saved by MedusaHeads.save (`draftwise train --kind medusa`) for target_model."""
    fields, tensors = read_head_files(folder, "medusa", FORMAT_VERSION)
    return fill_lm_head(MedusaHeads(MedusaConfig(**fields)), tensors, target_model)
