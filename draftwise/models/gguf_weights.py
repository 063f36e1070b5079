"""A GGUF file's tensors as the native decoder's weights, blocks kept as shipped.

GGUF names its tensors after llama.cpp (`blk.3.attn_q.weight`); the decoder reads transformers'
names (`model.layers.3.self_attn.q_proj.weight`). llama.cpp's converter also reorders the rows
of a Llama model's query and key projections for its rotary layout; transformers undoes that
when it dequantises, and so does this module, by moving whole rows of blocks (rows are
independent, so no block is touched).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as WeightFormat

from draftwise.errors import ModelLoadError
from draftwise.models.gguf_index import TensorEntry, read_index, read_index_and_metadata
from draftwise.models.linear import NATIVE_FORMATS

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # Qwen3's, Gemma 3's
# Gemma 3 norms each sublayer's input and output: llama.cpp's ffn_norm is its MLP's input norm
# (transformers' pre_feedforward_layernorm), post_attention_norm the attention's output norm.
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES, **QK_NORM_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHITECTURE_LAYER_NAMES = {"gemma3_text": GEMMA3_LAYER_NAMES, "qwen3": {**LAYER_NAMES, **QK_NORM_NAMES}}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors that are
    not the decoder's weights (rope_freqs is read by rope_scaling). architecture: transformers' model_type."""
    parts = gguf_name.split(".")
    names = ARCHITECTURE_LAYER_NAMES.get(architecture, LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def read_blocks(path: Path, architecture: str, num_heads: int, num_kv_heads: int) -> dict:
    """name -> (bytes [rows, bytes per row] uint8, WeightFormat, columns) for matrices, and
    name -> float32 tensor for vectors (norms, biases). Copied out of the memory map: the
    file's offsets are not cache-line aligned (35% slower reads, measured)."""
    try:
        entries = read_index(path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not read {path} as a GGUF file: {error}") from error
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict = {}
    for entry in entries:
        name = hf_name(entry.name, architecture)
        if name is None:
            continue
        data = torch.from_numpy(np.array(file[entry.offset:entry.offset + entry.num_bytes]))
        if len(entry.shape) == 1:
            if entry.format != WeightFormat.F32:
                raise ModelLoadError(f"{path}: vector {entry.name} is {entry.format.name}; only F32 vectors are supported.")
            tensors[name] = data.view(torch.float32)
            continue
        num_columns = int(entry.shape[0])
        rows = data.reshape(int(entry.shape[1]), -1)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            rows = rows[_llama_rotary_rows(rows.shape[0], num_heads if "q_proj" in name else num_kv_heads)]
        tensors[name] = (rows.contiguous(), entry.format, num_columns)
    return tensors


def rope_scaling(path: Path) -> tuple[torch.Tensor | None, dict]:
    """A GGUF file's rope scaling, which transformers' GGUF reader leaves out of the config it
    writes, from one pass over its header: (its rope_freqs tensor, llama.cpp's per-frequency
    divisors of the rotary angles, how it stores Llama 3.1+'s scaling, or None; its
    `<arch>.rope.scaling.*` metadata as a rope_parameters dict, a Gemma 3 4B file's linear factor 8
    on its global layers, or {}). loading.load gives them to the decoder's shape, whichever way the
    weights are stored."""
    prefix = ".rope.scaling."
    try:
        entries, values = read_index_and_metadata(path, lambda key: prefix in key)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not read {path} as a GGUF file: {error}") from error
    entry = next((e for e in entries if e.name == "rope_freqs.weight"), None)
    divisors = None if entry is None else _rope_freqs(path, entry)
    scaling = {key.split(prefix, 1)[1]: value for key, value in values.items()}
    kind = scaling.pop("type", "none")
    if kind == "none":
        return divisors, {}
    if "original_context_length" in scaling:
        scaling["original_max_position_embeddings"] = scaling.pop("original_context_length")
    return divisors, {"rope_type": kind, **scaling}


def _rope_freqs(path: Path, entry: TensorEntry) -> torch.Tensor:
    if entry.format != WeightFormat.F32:
        raise ModelLoadError(f"{path}: rope_freqs is {entry.format.name}; only F32 is supported.")
    data = np.fromfile(path, dtype=np.uint8, count=entry.num_bytes, offset=entry.offset)
    return torch.from_numpy(data.view(np.float32).copy())


def _llama_rotary_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's permutation of a Llama query/key projection (the
    inverse of convert_hf_to_gguf's `permute`, as transformers' GGUF loader applies it)."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def dequantised_note(path: Path, tensors: dict) -> str | None:
    """A warning's text where some of read_blocks' matrices are in a format the kernels do not run
    as blocks (TQ1_0, TQ2_0, MXFP4, ...): those are dequantised to float32 when the model
    is built, so they take 32 bits a weight in memory and in every forward. None where there are none."""
    others = {name: entry for name, entry in tensors.items()
              if isinstance(entry, tuple) and entry[1] not in NATIVE_FORMATS}
    if not others:
        return None
    formats = sorted({entry[1].name for entry in others.values()})
    matrices = [entry for entry in tensors.values() if isinstance(entry, tuple)]
    as_float = sum(entry[0].shape[0] * entry[2] * 4 for entry in others.values())
    as_stored = sum(entry[0].numel() for entry in others.values())
    native = sorted(format.name for format in NATIVE_FORMATS)
    return (f"{path.name}: {len(others)} of its {len(matrices)} weight matrices are {', '.join(formats)}, which "
            f"draftwise's kernels do not run as blocks: they are dequantised to float32 ({as_float / 2**20:,.0f} MB "
            f"in memory against {as_stored / 2**20:,.0f} MB in the file) and read at 32 bits a weight, slower. "
            f"The kernels run {', '.join(native)} as shipped: a Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS or Q8_0 file "
            "of the same model loads in its own bytes.")
