"""An EAGLE-style draft head: one decoder layer that reads the target's own hidden states.

EAGLE (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML
2024; EAGLE-2, EMNLP 2024; EAGLE-3, 2025) drafts with a small head instead of a second model.
Row r of the head reads the target's feature of position r and the embedding of token r + 1,
and predicts token r + 2. As in EAGLE-3 the feature fuses a low, a middle and a high layer of
the target (`fuse`), the head's own output is fed back as the next row's feature when the
target has not scored that position yet (deeper draft nodes), and it scores a reduced draft
vocabulary: the most frequent tokens of its training data, mapped to target ids by `draft_to_target`.

The head runs on PyTorch's float32 ops: its numerics only decide which tokens are proposed,
never what is emitted (the target verifies every one).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import quants
from torch import nn

from draftwise.errors import ConfigError
from draftwise.models.linear import WeightFormat, dequantize, quantize_blocks

Q8_0_WEIGHTS, Q8_0_BYTES = quants.GGML_QUANT_SIZES[WeightFormat.Q8_0]  # 32 weights in 34 bytes per block

CONFIG_NAME = "head.json"
WEIGHTS_NAME = "head.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class EagleConfig:
    target: str  # the target model the head was trained for (a registry name or path)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    hidden_layers: tuple[int, ...]  # the target layers whose outputs are fused (CausalLM.forward)
    draft_vocab_size: int
    target_vocab_size: int
    kind: str = "eagle"
    format_version: int = FORMAT_VERSION
    # The LM head is the target's own rows for the draft vocabulary, frozen in training: not
    # stored, filled from the target at load (10 MB less for SmolLM2).
    lm_head_from_target: bool = True
    # How head.safetensors stores the matrices: "q8_0" (GGUF's 8-bit blocks of 32, what the
    # drafter multiplies by anyway: half the bytes of "bf16", the same drafts) or "bf16".
    weight_storage: str = "q8_0"
    # draft_to_target lists the target's ids most frequent first (heads trained since 2026-11-26),
    # so a drafter may keep a prefix of the vocabulary; older heads list them by id.
    vocab_by_frequency: bool = False
    training: dict = field(default_factory=dict)  # how it was trained: data, steps, measured acceptance

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_layers", tuple(self.hidden_layers))

    @classmethod
    def for_target(cls, target_model, target_name: str, draft_vocab_size: int,
                   intermediate_size: int | None = None) -> "EagleConfig":
        """A head shaped like one of the target's layers, fusing its layers at ~10%, 50% and 90% depth;
        intermediate_size narrows its MLP (default: the target's), for targets whose layer is costly
        to run once per draft depth on a CPU."""
        s = target_model.shape
        if intermediate_size is not None and intermediate_size < 1:
            raise ConfigError(f"intermediate_size={intermediate_size}: the head's MLP needs at least 1 unit "
                              f"(the target's is {s.intermediate_size}).")
        last = s.num_layers - 1
        layers = tuple(sorted({max(1, round(0.1 * last)), round(0.5 * last), round(0.9 * last)}))
        return cls(target=target_name, hidden_size=s.hidden_size, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                   head_dim=s.head_dim, intermediate_size=intermediate_size or s.intermediate_size, rms_norm_eps=s.rms_norm_eps,
                   rope_theta=s.rope_theta, hidden_layers=layers, draft_vocab_size=draft_vocab_size,
                   target_vocab_size=s.vocab_size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [R, 1, head_dim] of the rotary angles at positions [R] (Llama's rotate-half form)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [R, heads, head_dim] given rotary_angles' cos and sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        h = c.hidden_size
        self.fuse = nn.Linear(len(c.hidden_layers) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, c.rms_norm_eps)
        self.feature_norm = RMSNorm(h, c.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.q_proj = nn.Linear(h, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size))  # [draft vocab] target ids

    def fuse_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [..., layers * hidden] -> the feature [..., hidden]. Each layer's
        state is scaled to unit RMS first: residual streams reach 1e4 in a few channels."""
        c = self.config
        layered = hidden.float().view(*hidden.shape[:-1], len(c.hidden_layers), c.hidden_size)
        layered = layered * torch.rsqrt(layered.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        return self.fuse(layered.flatten(-2))

    def inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """A row's input to the layer: features, token_embeds [R, hidden] -> x [R, hidden]."""
        return self.input_proj(torch.cat((self.embed_norm(token_embeds), self.feature_norm(features)), dim=-1))

    def project(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor):
        """A row's input and its query/key/value: features, token_embeds [R, hidden] ->
        (x [R, hidden], q [R, heads, d], k [R, kv_heads, d], v [R, kv_heads, d])."""
        c = self.config
        x = self.inputs(features, token_embeds)
        rows = x.shape[:-1]  # [R], or [B, R] for a batch of sequences (training)
        cos, sin = rotary_angles(positions, c.head_dim, c.rope_theta)  # once for q and k
        q = rotate(self.q_proj(x).view(*rows, c.num_heads, c.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(*rows, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(*rows, c.num_kv_heads, c.head_dim)
        return x, q, k, v

    def finish(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [R, heads, d] over keys / values [S, kv_heads, d] where mask [R, S]
        (True = may attend), then the MLP: -> the rows' outputs [R, hidden] (the next feature).
        A batch of sequences (training) adds a leading dimension B to x, q, keys and values."""
        batched = q.dim() == 4
        if not batched:
            q, keys, values = q[None], keys[None], values[None]
        # Training in bfloat16 (autocast): attention stays float32, as PyTorch's CPU attention
        # backward ran ~3x slower in bfloat16 (AMX Xeon, 124-189 rows).
        rounding = torch.is_autocast_enabled(q.device.type)
        with torch.autocast(q.device.type, enabled=False) if rounding else contextlib.nullcontext():
            if rounding:
                q, keys, values = q.float(), keys.float(), values.float()
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                      attn_mask=mask, enable_gqa=True)  # [B, heads, R, d]
        attended = attended.transpose(1, 2).flatten(-2)  # [B, R, heads * d]
        x = x + self.o_proj(attended if batched else attended[0])
        normed = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, draft vocab]
        return self.lm_head(self.norm(outputs))

    def save(self, folder: str | Path) -> Path:
        return save_head(self, folder)


def save_head(head: nn.Module, folder: str | Path) -> Path:
    """Write a head (EAGLE or Medusa) as folder/head.json + folder/head.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(head_state(head), folder / WEIGHTS_NAME)
    (folder / CONFIG_NAME).write_text(json.dumps(asdict(head.config), indent=2) + "\n")
    return folder


def head_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """What a head file stores: matrices as config.weight_storage says (Q8_0 block bytes, uint8
    [rows, bytes], or bfloat16: the head's numerics never reach the output), vectors in bfloat16,
    integer buffers as they are, and no LM head when it is the target's own."""
    storage = getattr(head.config, "weight_storage", "bf16")
    state = {}
    for name, tensor in head.state_dict().items():
        if name == "lm_head.weight" and head.config.lm_head_from_target:
            continue
        tensor = tensor.detach().cpu()
        if storage == "q8_0" and tensor.dim() == 2 and tensor.is_floating_point() and tensor.shape[1] % Q8_0_WEIGHTS == 0:
            state[name] = quantize_blocks(tensor, WeightFormat.Q8_0)
        else:
            state[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _float_tensors(tensors: dict[str, torch.Tensor], storage: str) -> dict[str, torch.Tensor]:
    """A head file's tensors as float32 (Q8_0 block bytes dequantized), integer buffers as they are."""
    if storage not in ("q8_0", "bf16"):
        raise ConfigError(f"weight_storage={storage!r} is not a head storage: this reads q8_0 or bf16; "
                          "retrain the head with `draftwise train`.")
    out = {}
    for name, tensor in tensors.items():
        if storage == "q8_0" and tensor.dtype == torch.uint8 and tensor.dim() == 2:
            out[name] = dequantize(tensor, WeightFormat.Q8_0, tensor.shape[1] // Q8_0_BYTES * Q8_0_WEIGHTS)
        else:
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out


def read_head_config(folder: str | Path, kind: str, format_version: int) -> dict:
    """A head folder's config fields, or a clear error where it is not a head of this kind and
    format (cheap: draftwise.load asks before it loads the target)."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise ConfigError(f"{folder} is not a draft head: it needs {CONFIG_NAME} and {WEIGHTS_NAME} "
                          "(as written by `draftwise train` into OUT/eagle or OUT/medusa).")
    fields = json.loads(config_path.read_text())
    if fields.get("kind") in ("eagle", "medusa") and fields.get("kind") != kind:
        raise ConfigError(f"{folder} is a head for --drafter {fields['kind']}, not --drafter {kind}: pass it with "
                          f"--drafter {fields['kind']}, or train one for {kind} with `draftwise train --kind {kind}`.")
    if fields.get("format_version") != format_version or fields.get("kind") != kind:
        raise ConfigError(f"{config_path} is a {fields.get('kind')!r} head of format {fields.get('format_version')}; "
                          f"this reads {kind!r} heads of format {format_version}: retrain it with "
                          f"`draftwise train --kind {kind}`.")
    return fields


def read_head_files(folder: str | Path, kind: str, format_version: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A head folder's config fields and float32 tensors, or a clear error."""
    from safetensors.torch import load_file

    fields = read_head_config(folder, kind, format_version)
    # Files written before weight_storage existed hold bfloat16 matrices.
    return fields, _float_tensors(load_file(Path(folder) / WEIGHTS_NAME), fields.setdefault("weight_storage", "bf16"))


def fill_lm_head(head: nn.Module, tensors: dict[str, torch.Tensor], target_model) -> nn.Module:
    """Load tensors into head, checking the target first and taking its LM head rows if not stored."""
    from draftwise.heads import check_target, lm_head_rows

    check_target(head.config, target_model)
    if head.config.lm_head_from_target:
        tensors = {**tensors, "lm_head.weight": lm_head_rows(target_model, tensors["draft_to_target"])}
    head.load_state_dict(tensors)
    return head.eval()


def load_head(folder: str | Path, target_model) -> EagleHead:
    """A head saved by EagleHead.save (`draftwise train`) for target_model: head.json + head.safetensors."""
    fields, tensors = read_head_files(folder, "eagle", FORMAT_VERSION)
    return fill_lm_head(EagleHead(EagleConfig(**fields)), tensors, target_model)
