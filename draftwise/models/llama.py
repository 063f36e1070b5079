"""A native PyTorch decoder for Llama-family weights (Llama, SmolLM2, Qwen2, Mistral).

It reads the HF state-dict names, so any checkpoint transformers can load for these
architectures loads here too. The KV cache is static (draftwise.kv_cache), so rolling back a
rejected draft costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.errors import ModelLoadError
from draftwise.kv_cache import KVCache
from draftwise.models.base import ModelInfo

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_context: int

    @classmethod
    def from_hf_config(cls, config) -> "DecoderShape":
        """Read a transformers PretrainedConfig; refuse what this decoder would get wrong."""
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {config.model_type!r} is not supported by the native decoder; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ModelLoadError(f"rope scaling {rope_type!r} is not supported yet (only 'default').")
        max_context = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
            # Within the window, sliding-window attention is full attention: cap the context
            # there rather than silently attend too far.
            max_context = min(max_context, window)
        num_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_context=max_context,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                start: int, mask: torch.Tensor | None) -> torch.Tensor:  # x: [T, hidden]
        num_tokens = x.shape[0]
        s = self.shape
        # [T, hidden] -> [1, heads, T, head_dim]
        q = self.q_proj(x).view(1, num_tokens, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, num_tokens, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, num_tokens, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, start, k, v)  # [1, kv_heads, start + T, head_dim]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                start: int, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named like transformers' `model.` prefix so state dicts load unchanged."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaModel(nn.Module):
    """Implements draftwise.models.base.CausalLM."""

    def __init__(self, shape: DecoderShape, info: ModelInfo) -> None:
        super().__init__()
        self.shape = shape
        self.info = info
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.register_buffer("inv_freq", _rope_inverse_frequencies(shape), persistent=False)

    @classmethod
    def from_state_dict(cls, shape: DecoderShape, info: ModelInfo, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> "LlamaModel":
        """Build without random initialisation (meta device) and adopt the given tensors."""
        with torch.device("meta"):
            model = cls(shape, info)
        # copy=True: safetensors hands out tensors inside the mmapped file, at offsets not
        # aligned to cache lines; a Qwen2.5-1.5B step read them 35% slower there (293 vs 213 ms).
        state_dict = {name: tensor.to(dtype, copy=True) for name, tensor in state_dict.items()
                      if name.startswith(("model.", "lm_head."))}
        if "lm_head.weight" not in state_dict:
            if not shape.tie_word_embeddings:
                raise ModelLoadError("checkpoint has no lm_head.weight and does not tie embeddings.")
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        # A truncated copy (a draft made of the first layers) drops the deeper layers' weights.
        state_dict = {name: tensor for name, tensor in state_dict.items() if _layer_index(name) < shape.num_layers}
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if missing or unexpected:
            raise ModelLoadError(f"checkpoint does not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.inv_freq = _rope_inverse_frequencies(shape)  # buffers made on meta hold no values
        return model.eval()

    def truncated(self, num_layers: int) -> "LlamaModel":
        """A cheaper model made of this one's first num_layers layers, sharing its modules (and
        so its weights, whatever their kernels): a free draft that agrees with the target often
        but not always."""
        if not 1 <= num_layers <= self.shape.num_layers:
            raise ModelLoadError(f"num_layers={num_layers} must be in 1..{self.shape.num_layers}")
        with torch.device("meta"):
            model = LlamaModel(replace(self.shape, num_layers=0), replace(self.info, name=f"{self.info.name}[:{num_layers} layers]"))
        model.shape = replace(self.shape, num_layers=num_layers)
        model.model.embed_tokens = self.model.embed_tokens
        model.model.layers = nn.ModuleList(self.model.layers[:num_layers])
        model.model.norm = self.model.norm
        model.lm_head = self.lm_head
        model.inv_freq = self.inv_freq
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (weights may be quantized below it)."""
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, max_length: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, max_length, dtype=self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # [T, T] bool, True = may attend
        num_logits: int | None = None,  # score only the last num_logits tokens (prefill needs 1)
    ) -> torch.Tensor:  # [num_logits or T, vocab] float32
        num_tokens = tokens.shape[0]
        start = cache.reserve(num_tokens)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos().to(self.dtype)  # broadcast against [1, heads, T, head_dim]
        sin = angles.sin().to(self.dtype)
        mask = _attention_mask(start, num_tokens, attn_mask)
        x = self.model.embed_tokens(tokens)  # [T, hidden]
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, index, start, mask)
        if num_logits is not None:
            x = x[-num_logits:]
        return self.lm_head(self.model.norm(x)).float()


def _rope_inverse_frequencies(shape: DecoderShape) -> torch.Tensor:
    exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim
    return 1.0 / (shape.rope_theta**exponents)  # [head_dim / 2]


def _attention_mask(start: int, num_tokens: int, tree_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[T, start + T] bool: every new token sees all cached slots, and among the new tokens
    either the causal order or the given tree mask. One token alone needs no mask."""
    if tree_mask is None:
        if num_tokens == 1:
            return None
        tree_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    prefix = torch.ones(num_tokens, start, dtype=torch.bool)
    return torch.cat((prefix, tree_mask), dim=1)


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1
