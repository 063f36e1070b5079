"""A native decoder for Llama-family weights (Llama, SmolLM2, Qwen2, Mistral) and Gemma 3's.

It reads the HF state-dict names, so any checkpoint transformers can load for these
architectures loads here too, and GGUF files with their quantized blocks as shipped
(models/gguf_weights.py). The KV cache is static (draftwise.kv_cache), so rolling back a
rejected draft costs nothing.

Batch invariance: every op computes a token's row with the same arithmetic whatever else the
forward holds (one token, a draft, a tree, a prefill): linears and the embedding on
draftwise's kernels (models/linear.py), RMSNorm, the gated MLP and attention in models/ops.py,
rotary angles from a table filled in fixed-size chunks. So a position's logits are
bit-identical however they were computed, and greedy speculation equals plain greedy decoding
in every weight format (tests/test_batch_invariance.py). Activations are float32.

Where the kernels are built, a forward runs all layers in one call (kernels.Decoder,
kernels/decoder.cpp): the same kernels in the same order as the modules below, so the same
bits (tested), without about twenty Python calls a layer (SmolLM2: 12.7 -> 9.0 ms a token).
The modules remain the reference and the path without kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from draftwise.errors import ConfigError, ModelLoadError
from draftwise.kv_cache import KVCache
from draftwise.models import ops
from draftwise.models.base import ModelInfo, Segment
from draftwise.models.kernels import native_kernels
from draftwise.models.linear import (ACTIVATION_CODES, BlockEmbedding, BlockLinear, BlockWeight, WeightFormat,
                                     store_weights)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


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
    # Where Gemma 3 differs from Llama (the defaults are Llama's):
    embed_scale: float = 1.0  # the embedding's rows are multiplied by it (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # a checkpoint's norm weight w scales by norm_offset + w (Gemma's 1; GGUF files hold 1 + w)
    qk_norm: bool = False  # each head's query and key RMS-normed before the rotary embedding
    sandwich_norms: bool = False  # the attention's and the MLP's outputs normed too, before each joins the residual
    gelu: bool = False  # the MLP gates with GELU's tanh approximation, not SiLU
    attention_scale: float = 0.0  # the scores' scale; 0: head_dim ** -0.5
    sliding_window: int = 0  # what the local layers attend within (keys p - window + 1 .. p)
    local_layers: tuple[int, ...] = ()  # the layers that attend within the window
    local_rope_theta: float = 0.0  # the local layers' own rotary base (Gemma 3's); 0: they rotate as the others do
    # Per-frequency divisors of the rotary angles (Llama 3.1+'s "llama3" scaling, "linear" scaling; a
    # GGUF file's rope_freqs tensor, llama.cpp's form of the same): () for none. The local layers
    # of Gemma 3 take none.
    rope_factors: tuple[float, ...] = ()
    # YaRN's scale of the rotary cos and sin (so of every attention score, squared): 1 for none.
    rope_attention_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, config) -> "DecoderShape":
        """Read a transformers PretrainedConfig; refuse what this decoder would get wrong."""
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {config.model_type!r} is not supported by the native decoder; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        if config.model_type == "gemma3_text":
            return cls._gemma3(config)
        rope = _rope_parameters(config, getattr(config, "rope_parameters", None) or {})
        sizes = _sizes(config)
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        max_context = rope_context(rope, config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        local_layers = ()
        layer_types = getattr(config, "layer_types", None)
        if window and config.model_type in ("qwen2", "qwen3") and layer_types:
            # Qwen's sliding layers (layer_types: those from max_window_layers on, with use_sliding_window)
            # attend within the decoder's window (Gemma 3's), rotated as the other layers are
            local_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        elif window and config.model_type == "mistral":  # every layer within the window
            local_layers = tuple(range(config.num_hidden_layers))
        elif window and getattr(config, "use_sliding_window", False):
            # Within the window, sliding-window attention is full attention: cap the context
            # there rather than silently attend too far.
            max_context = min(max_context, window)
        return cls(
            **sizes,
            rope_theta=theta,
            rope_factors=rope_divisors(rope, sizes["head_dim"], theta),
            rope_attention_factor=rope_attention_factor(rope),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_context=max_context,
            qk_norm=config.model_type == "qwen3",  # Qwen3 norms each head's query and key (w, not Gemma's 1 + w)
            sliding_window=window if local_layers else 0,
            local_layers=local_layers,
        )

    @classmethod
    def _gemma3(cls, config) -> "DecoderShape":
        """Gemma 3's text decoder (transformers' Gemma3TextConfig): Llama's layers plus scaled
        embeddings, norms of 1 + w, per-head query and key norms, norms of each sublayer's output,
        a GELU-gated MLP, and local layers that attend within a sliding window with a rotary base
        of their own (every sixth layer global)."""
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ModelLoadError(f"{name}={getattr(config, name)}: Gemma 2's logit soft-capping is not implemented "
                                     "by the native decoder (Gemma 3 has none).")
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("use_bidirectional_attention: an encoder's attention, not a causal LM's.")
        activation = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ModelLoadError(f"hidden_activation {activation!r}: the native Gemma 3 decoder gates with "
                                 "'gelu_pytorch_tanh' only.")
        rope = getattr(config, "rope_parameters", None) or {}
        full = _rope_parameters(config, rope.get("full_attention") or {"rope_theta": getattr(config, "rope_theta", 1_000_000.0)})
        local = rope.get("sliding_attention") or {"rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling {local['rope_type']!r} on the sliding-window layers is not supported "
                                 "(only 'default').")
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # older configs: every pattern-th layer global
            pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(config.num_hidden_layers)]
        sizes = _sizes(config)
        return cls(
            **sizes,
            rope_theta=full["rope_theta"],
            rope_factors=rope_divisors(full, sizes["head_dim"], full["rope_theta"]),  # the larger Gemma 3s: linear 8
            rope_attention_factor=rope_attention_factor(full),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            max_context=rope_context(full, config.max_position_embeddings),
            embed_scale=config.hidden_size ** 0.5,
            norm_offset=1.0,
            qk_norm=True,
            sandwich_norms=True,
            gelu=True,
            attention_scale=config.query_pre_attn_scalar ** -0.5,
            sliding_window=config.sliding_window or 0,
            local_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"),
            local_rope_theta=local["rope_theta"],
        )


def _rope_parameters(config, parameters: dict) -> dict:
    """A config's rope parameters, refused where the decoder would rotate differently (a partial
    rotary dimension) and completed as transformers completes them (YaRN's factor from the two
    context lengths where the config gives none)."""
    partial = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial}: the native decoder rotates whole heads.")
    if parameters.get("rope_type") == "yarn":
        parameters = {"original_max_position_embeddings": config.max_position_embeddings, **parameters}
        if parameters.get("factor") is None:
            parameters["factor"] = config.max_position_embeddings / parameters["original_max_position_embeddings"]
    return parameters


def rope_divisors(parameters: dict, head_dim: int, theta: float) -> tuple[float, ...]:
    """The per-frequency divisors of the rotary angles a config's rope scaling asks for ("linear":
    all frequencies by `factor`; "llama3": the low frequencies by `factor`, the high ones not, the
    band between smoothly, as transformers' _compute_llama3_parameters; "yarn": the same shape of
    band, bounded by how many turns a frequency makes within the original context, as
    _compute_yarn_parameters and llama.cpp's rope_yarn), in llama.cpp's form of a divisor per
    frequency; () for "default"; anything else is refused by name."""
    kind = parameters.get("rope_type", "default")
    if kind == "default":
        return ()
    if kind == "linear":
        return (float(parameters["factor"]),) * (head_dim // 2)
    if kind == "yarn":
        return _yarn_divisors(parameters, head_dim, theta)
    if kind != "llama3":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported by the native decoder (it runs 'default', "
                             "'linear', 'llama3' and 'yarn').")
    factor, low, high = (float(parameters[key]) for key in ("factor", "low_freq_factor", "high_freq_factor"))
    old_context = float(parameters["original_max_position_embeddings"])
    divisors = []
    for index in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (index / head_dim)
        if wavelength < old_context / high:
            divisors.append(1.0)
        elif wavelength > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


def _yarn_divisors(parameters: dict, head_dim: int, theta: float) -> tuple[float, ...]:
    """YaRN (Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models",
    2023): frequency i keeps its trained angle (divisor 1) where it turns more than beta_fast
    times within the original context, is divided by `factor` where it turns fewer than
    beta_slow times, and blends linearly in between, over frequency indices rounded outwards
    (transformers' truncate, llama.cpp's floor / ceil)."""
    factor, old_context = float(parameters["factor"]), float(parameters["original_max_position_embeddings"])
    fast, slow = float(parameters.get("beta_fast") or 32), float(parameters.get("beta_slow") or 1)

    def index(turns: float) -> float:  # the frequency index that turns `turns` times within the original context
        return head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(fast), index(slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = high - low if high != low else 0.001
    divisors = []
    for i in range(head_dim // 2):
        kept = 1.0 - min(1.0, max(0.0, (i - low) / span))  # the share of the trained angle
        divisors.append(1.0 / ((1 - kept) / factor + kept))
    return tuple(divisors)


def rope_attention_factor(parameters: dict) -> float:
    """YaRN's scale of cos and sin: `attention_factor` where given, else 0.1 ln(factor) + 1 (with
    DeepSeek's mscale / mscale_all_dim where both are given), as transformers computes it; 1 for
    every other kind of scaling."""
    if parameters.get("rope_type") != "yarn":
        return 1.0
    if parameters.get("attention_factor") is not None:
        return float(parameters["attention_factor"])
    factor = float(parameters["factor"])

    def magnitude(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return magnitude(mscale) / magnitude(mscale_all_dim)
    return magnitude()


def with_rope_scaling(shape: DecoderShape, parameters: dict) -> DecoderShape:
    """shape with a rope_parameters dict's scaling (a GGUF file's metadata, --rope-scaling): its
    divisors, YaRN's cos/sin scale, and the context YaRN extends to."""
    return replace(shape, rope_factors=rope_divisors(parameters, shape.head_dim, shape.rope_theta),
                   rope_attention_factor=rope_attention_factor(parameters),
                   max_context=rope_context(parameters, shape.max_context))


def requested_rope_scaling(text: str) -> dict:
    """`--rope-scaling yarn:FACTOR` (llama.cpp's `--rope-scaling yarn --rope-scale FACTOR`) as rope
    parameters; the original context is the model's own (loading.load fills it in)."""
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = None
    if kind != "yarn" or value is None or not value > 1:
        raise ConfigError(f"--rope-scaling {text!r}: give yarn:FACTOR with a FACTOR above 1, e.g. yarn:4 (Qwen2.5's "
                          "long-context setting: 4 x 32,768 positions).")
    return {"rope_type": "yarn", "factor": value}


def rope_context(parameters: dict, max_position: int) -> int:
    """The positions a model reaches: max_position, or with YaRN `factor` times the original
    context where that is more (Qwen2.5's recipe adds yarn with factor 4 to a config whose
    max_position_embeddings stays 32,768; vLLM likewise serves the scaled length)."""
    if parameters.get("rope_type") != "yarn":
        return max_position
    return max(max_position, int(float(parameters["factor"]) * float(parameters["original_max_position_embeddings"])))


def _sizes(config) -> dict:
    """The sizes every architecture's config gives alike (DecoderShape's first fields)."""
    num_heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
    )


class CheckpointLinear(nn.Linear):
    """An nn.Linear whose weights a checkpoint fills: built on the meta device and never given
    random values (nn.Linear's own initialisation there runs PyTorch's Python meta kernels, whose
    first use cost ~2.3 s of a load in cProfile; loads measured ~0.8 s faster without it, since
    transformers imports part of the same later). The loaders replace or assign every parameter,
    and check none is left."""

    def reset_parameters(self) -> None:
        pass


class CheckpointEmbedding(nn.Embedding):
    """As CheckpointLinear, for the token embedding."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, size] float32
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        self.q_proj = CheckpointLinear(shape.hidden_size, q_size, bias=shape.qkv_bias)
        self.k_proj = CheckpointLinear(shape.hidden_size, kv_size, bias=shape.qkv_bias)
        self.v_proj = CheckpointLinear(shape.hidden_size, kv_size, bias=shape.qkv_bias)
        self.o_proj = CheckpointLinear(q_size, shape.hidden_size, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                spans: list["Span"]) -> torch.Tensor:  # x: [N, hidden], every sequence's rows
        num_tokens = x.shape[0]
        s = self.shape
        # [N, hidden] -> [N, heads, head_dim]; cos, sin [N, 1, head_dim]. The projections read
        # each weight once for all sequences' rows; attention is per sequence, over its cache.
        q = self.q_proj(x).view(num_tokens, s.num_heads, s.head_dim)
        k = self.k_proj(x).view(num_tokens, s.num_kv_heads, s.head_dim)
        v = self.v_proj(x).view(num_tokens, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # each head's row (kernels/decoder.cpp's order)
            q = self.q_norm(q.reshape(-1, s.head_dim)).view(num_tokens, s.num_heads, s.head_dim)
            k = self.k_norm(k.reshape(-1, s.head_dim)).view(num_tokens, s.num_kv_heads, s.head_dim)
        q = ops.rotary(q, cos, sin)
        k = ops.rotary(k, cos, sin)
        outputs = []
        # Scores on AMX tiles where the projections run there too (kernels/decoder.cpp's rule).
        amx_scores = getattr(self.q_proj.weight, "activations", None) == "amx"
        for span in spans:
            rows = slice(span.first_row, span.first_row + span.num_rows)
            cache = span.segment.cache
            cache.write(layer, span.start, k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None])
            outputs.append(ops.attention(q[rows], cache.keys[layer, 0], cache.values[layer, 0], span.start,
                                         span.segment.attn_mask, amx_scores, s.attention_scale or None,
                                         s.sliding_window if layer in s.local_layers else 0))  # [T, heads, head_dim]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.gate_proj = CheckpointLinear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = CheckpointLinear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = CheckpointLinear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.gated = ops.gelu_tanh_mul if shape.gelu else ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)
        self.sandwich = shape.sandwich_norms
        if self.sandwich:  # Gemma's: post_attention_layernorm norms the attention's output instead
            self.pre_feedforward_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                spans: list["Span"]) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, layer, spans))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, spans)
        return x + self.mlp(self.post_attention_layernorm(x))

    def norms(self) -> dict[str, torch.Tensor | None]:
        """kernels.Decoder.add_layer's norms: the MLP's input norm and Gemma's extras (None: none)."""
        attention = self.self_attn
        return {
            "mlp_norm": (self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm).weight,
            "q_norm": attention.q_norm.weight if hasattr(attention, "q_norm") else None,
            "k_norm": attention.k_norm.weight if hasattr(attention, "k_norm") else None,
            "attention_output_norm": self.post_attention_layernorm.weight if self.sandwich else None,
            "mlp_output_norm": self.post_feedforward_layernorm.weight if self.sandwich else None,
        }


class Backbone(nn.Module):
    """Named like transformers' `model.` prefix so state dicts load unchanged."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = CheckpointEmbedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaModel(nn.Module):
    """Implements draftwise.models.base.CausalLM."""

    def __init__(self, shape: DecoderShape, info: ModelInfo) -> None:
        super().__init__()
        self.shape = shape
        self.info = info
        self.model = Backbone(shape)
        self.lm_head = CheckpointLinear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope = RopeTable(shape)
        # Gemma 3's local layers rotate by a base of their own (without the global layers' scaling).
        self.local_rope = RopeTable(shape, shape.local_rope_theta, (), 1.0) if shape.local_rope_theta else None
        self.embed_scale = torch.tensor(shape.embed_scale, dtype=torch.float32, device="cpu")
        # Run the layers through kernels.Decoder where it is built (one call for all of them);
        # False runs the modules one by one (the reference the tests compare it with).
        self.compiled_layers = True
        # What new caches store keys and values in (loading.load: --kv-cache). bfloat16 halves the
        # bytes attention reads per token; the arithmetic stays float32 either way.
        self.cache_dtype = torch.float32
        self._decoder = None  # (kernels.Decoder, its weights, their activations when built)

    @classmethod
    def from_state_dict(cls, shape: DecoderShape, info: ModelInfo, state_dict: dict[str, torch.Tensor],
                        format: WeightFormat = WeightFormat.F32, quantize: str | None = None) -> "LlamaModel":
        """Build from float tensors (HF names), storing the weights in format (F32, BF16, F16) or
        in quantize's block format ("int8", "int4"); norms and biases stay float32."""
        with torch.device("meta"):
            model = cls(shape, info)
        state_dict = {name: tensor.float() for name, tensor in state_dict.items() if name.startswith(("model.", "lm_head."))}
        if shape.norm_offset:  # Gemma's norms scale by 1 + w: stored so, as a GGUF file stores them
            state_dict = {name: tensor + shape.norm_offset if name.endswith("norm.weight") else tensor
                          for name, tensor in state_dict.items()}
        if "lm_head.weight" not in state_dict:
            if not shape.tie_word_embeddings:
                raise ModelLoadError("checkpoint has no lm_head.weight and does not tie embeddings.")
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        # A truncated copy (a draft made of the first layers) drops the deeper layers' weights.
        state_dict = {name: tensor for name, tensor in state_dict.items() if _layer_index(name) < shape.num_layers}
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if missing or unexpected:
            raise ModelLoadError(f"checkpoint does not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
        # store_weights copies every matrix into its own buffer (aligned; not in a file mapping).
        return store_weights(model, format, quantize).eval()

    @classmethod
    def from_blocks(cls, shape: DecoderShape, info: ModelInfo, tensors: dict) -> "LlamaModel":
        """Build from models/gguf_weights.read_blocks: matrices as (bytes, format, columns),
        kept in their blocks; vectors as float32 tensors."""
        with torch.device("meta"):
            model = cls(shape, info)
        if "lm_head.weight" not in tensors:
            tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
        weights: dict[int, BlockWeight] = {}  # one BlockWeight per GGUF tensor (tied embeddings)
        vectors = {}
        for name, value in tensors.items():
            if _layer_index(name) >= shape.num_layers:
                continue
            if isinstance(value, torch.Tensor):
                vectors[name] = value
                continue
            module_name = name.removesuffix(".weight")
            weight = weights.setdefault(id(value), BlockWeight(*value))
            parent, _, child = module_name.rpartition(".")
            wrapper = BlockEmbedding(weight) if child == "embed_tokens" else BlockLinear(weight)
            setattr(model.get_submodule(parent), child, wrapper)
        for name, vector in vectors.items():  # norms, and biases of linears already replaced
            parent, _, child = name.rpartition(".")
            module = model.get_submodule(parent)
            if child == "bias":
                module.bias = vector
            else:
                module.weight = nn.Parameter(vector, requires_grad=False)
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_meta:
                raise ModelLoadError(f"the GGUF file has no tensor for {name}")
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
        model.rope = self.rope
        model.local_rope = self.local_rope
        model.embed_scale = self.embed_scale
        model.cache_dtype = self.cache_dtype
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: float32 whatever format the weights are stored in."""
        return torch.float32

    def new_cache(self, max_length: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, max_length, dtype=self.cache_dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # [T, T] bool among the new tokens, True = may attend; None = causal
        num_logits: int | None = None,  # score only the last num_logits tokens (prefill needs 1)
        hidden_layers: tuple[int, ...] = (),  # also return these layers' outputs (see CausalLM.forward)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [num_logits or T, vocab] float32 (, [T, layers * hidden])
        """One sequence: forward_batch with a batch of one (the same code, the same bits)."""
        return self.forward_batch([Segment(tokens, positions, cache, attn_mask, num_logits)], hidden_layers)[0]

    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment], hidden_layers: tuple[int, ...] = ()) -> list:
        """Score every segment's new tokens in one pass (see CausalLM.forward_batch): the linears
        read each weight once for all rows, attention runs per sequence over its own cache."""
        num_layers = self.shape.num_layers
        if any(not 0 <= layer <= num_layers for layer in hidden_layers):
            raise ValueError(f"hidden_layers {hidden_layers} must lie in 0..{num_layers} for {self.info.name}")
        spans, first_row = [], 0
        for segment in segments:
            num_rows = segment.tokens.shape[0]
            spans.append(Span(segment, segment.cache.reserve(num_rows), first_row, num_rows))
            first_row += num_rows
        tokens = segments[0].tokens if len(segments) == 1 else torch.cat([s.tokens for s in segments])
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        cos, sin = self.rope.lookup(positions)  # [N, 1, head_dim] each
        local_cos, local_sin = self.local_rope.lookup(positions) if self.local_rope is not None else (cos, sin)
        x = self.model.embed_tokens(tokens)  # [N, hidden]
        if self.shape.embed_scale != 1.0:
            x = x * self.embed_scale  # one rounding an element, whatever the rows
        decoder = self._compiled_decoder(spans)
        if decoder is not None:  # the same kernels in one call (kernels/decoder.cpp): the same bits
            kept = sorted({layer for layer in hidden_layers if layer < num_layers})
            rows = x.shape[0]
            x, *states = decoder.forward(
                x, cos.view(rows, -1), sin.view(rows, -1),
                [span.segment.cache.keys for span in spans], [span.segment.cache.values for span in spans],
                [span.start for span in spans], [span.first_row for span in spans], [span.num_rows for span in spans],
                [_NO_MASK if span.segment.attn_mask is None else span.segment.attn_mask.contiguous() for span in spans],
                kept, *((local_cos.view(rows, -1), local_sin.view(rows, -1)) if self.local_rope is not None else ()))
            saved = dict(zip(kept, states))
        else:
            saved: dict[int, torch.Tensor] = {}
            local_layers = self.shape.local_layers
            for index, layer in enumerate(self.model.layers):
                x = layer(x, *((local_cos, local_sin) if index in local_layers else (cos, sin)), index, spans)
                if index in hidden_layers:
                    saved[index] = x
        # The rows each segment wants scored: its last num_logits (None = all of them).
        scored = [span.scored_rows() for span in spans]
        rows = scored[0] if len(scored) == 1 else [row for rows in scored for row in rows]
        if num_layers in hidden_layers:
            x = saved[num_layers] = self.model.norm(x)  # row-wise: the same bits on all rows or a slice
        if not len(rows):  # prefill chunks only: nothing to score
            logits = x.new_empty(0, self.shape.vocab_size)
        elif num_layers in hidden_layers:
            logits = self.lm_head(_take(x, rows))
        else:
            logits = self.lm_head(self.model.norm(_take(x, rows)))
        results, first = [], 0
        for span, rows in zip(spans, scored):
            result = logits[first:first + len(rows)]
            first += len(rows)
            if hidden_layers:
                result = (result, torch.cat([saved[layer][span.rows] for layer in hidden_layers], dim=-1))
            results.append(result)
        return results

    def _compiled_decoder(self, spans: list["Span"]):
        """kernels.Decoder over this model's layers, or None where the modules must run one by
        one: no compiled kernels, a head size attention's kernel does not take, a cache other
        than KVCache, or `compiled_layers` turned off (the reference the tests compare with).
        Rebuilt when a linear's activations change (linear.use_activations)."""
        kernels = native_kernels(progress=False)
        if (kernels is None or not self.compiled_layers or self.shape.head_dim % 16
                or not all(type(span.segment.cache) is KVCache for span in spans)):
            return None
        if self._decoder is not None:
            decoder, weights, settings = self._decoder
            if [weight.activations for weight in weights] == settings:
                return decoder
        s = self.shape
        decoder = kernels.Decoder(s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.attention_scale,
                                  s.sliding_window, s.gelu)
        weights = []
        for index, layer in enumerate(self.model.layers):
            linears = [getattr(module, name) for module, name in _layer_linears(layer)]
            norms = layer.norms()
            decoder.add_layer(layer.input_layernorm.weight, norms.pop("mlp_norm"),
                              [linear.weight.data for linear in linears],
                              [int(linear.weight.format) for linear in linears],
                              [linear.weight.num_columns for linear in linears],
                              [ACTIVATION_CODES[linear.weight.activations] for linear in linears],
                              [_NO_BIAS if linear.bias is None else linear.bias for linear in linears],
                              **{name: _NO_BIAS if norm is None else norm for name, norm in norms.items()},
                              local=index in s.local_layers)
            weights += [linear.weight for linear in linears]
        self._decoder = (decoder, weights, [weight.activations for weight in weights])
        return decoder


def _layer_linears(layer: DecoderLayer) -> list[tuple[nn.Module, str]]:
    """A layer's linears in kernels.Decoder's order: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
            (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_BIAS = torch.empty(0)


@dataclass(slots=True)
class Span:
    """Where a segment's rows sit in a batched forward, and where its cache writes them."""

    segment: Segment
    start: int  # first cache slot of the new tokens
    first_row: int  # first row in the flattened batch
    num_rows: int

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.num_rows)

    def scored_rows(self) -> range:
        wanted = self.num_rows if self.segment.num_logits is None else min(self.segment.num_logits, self.num_rows)
        return range(self.first_row + self.num_rows - wanted, self.first_row + self.num_rows)


def _take(x: torch.Tensor, rows: range | list[int]) -> torch.Tensor:
    """x's rows, as a view when they are contiguous (the single-sequence case)."""
    if isinstance(rows, range):
        return x[rows.start:rows.stop]
    return x[rows]


class RopeTable:
    """cos / sin of every position's rotary angles, computed once per chunk of ROPE_CHUNK
    positions by the same ops on the same sizes, so a position's values never depend on how
    many positions a forward holds (elementwise kernels may round a vector tail differently)."""

    ROPE_CHUNK = 1024

    def __init__(self, shape: DecoderShape, theta: float | None = None, factors: tuple[float, ...] | None = None,
                 scale: float | None = None) -> None:
        """theta: the rotary base (None: shape.rope_theta); factors: each frequency's divisor (None:
        shape.rope_factors); scale: what cos and sin are multiplied by (None: shape.rope_attention_factor)."""
        exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device="cpu") / shape.head_dim
        self.inv_freq = 1.0 / ((theta or shape.rope_theta)**exponents)  # [head_dim / 2]
        factors = shape.rope_factors if factors is None else factors
        if factors:
            self.inv_freq = self.inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        self.scale = shape.rope_attention_factor if scale is None else scale
        self.cos = torch.empty(0, shape.head_dim, device="cpu")
        self.sin = torch.empty(0, shape.head_dim, device="cpu")

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> 2 x [T, 1, head_dim]
        # One host sync per forward: the table grows before the lookup.
        while self.cos.shape[0] <= int(positions.max()):
            first = self.cos.shape[0]
            freqs = torch.arange(first, first + self.ROPE_CHUNK).float()[:, None] * self.inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)  # [ROPE_CHUNK, head_dim]
            cos, sin = angles.cos(), angles.sin()
            if self.scale != 1.0:  # YaRN: one multiplication an element, as transformers' attention_scaling
                cos, sin = cos * self.scale, sin * self.scale
            self.cos = torch.cat((self.cos, cos))
            self.sin = torch.cat((self.sin, sin))
        return self.cos[positions][:, None], self.sin[positions][:, None]


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1
