"""Weights as stored: linear layers and embeddings over GGUF block formats, float32 activations.

Every weight of the native decoder lives in one of GGUF's formats (`WeightFormat`): the
quantized blocks of a GGUF file as shipped (Q4_K, Q6_K, Q5_0, Q4_1, Q8_0, ...), bfloat16 or
float16 halves, or float32. draftwise's kernel (kernels/linear.cpp) reads each block once per
forward for a decode or verify step, decodes it in registers and multiplies it in float32: a
4-bit file is read at ~4.5 bits a weight instead of the 32 of a dequantised copy, and a row's
result never depends on the rows beside it (batch invariance, kernels/vec.h).

`--quantize int8|int4` re-quantizes float weights into Q8_0 / Q4_1 blocks (32 weights, one
float16 scale, plus a float16 minimum for Q4_1): the same kernel, the same invariance.

`--activations int8` rounds each row of a linear's input to 8 bits per 32 columns (per 256
for Q4_K / Q5_K / Q6_K; one float scale each) and multiplies it against the blocks with exact integer
dot products (kernels/int8_linear.cpp): about 1.8x faster for a decode step on a Q4_K_M file,
still batch-invariant, and as close to float32 activations as llama.cpp is (docs/weight-formats.md, "int8
activations": on Qwen2.5-1.5B mean KL 0.08 nats, top-1 0.960; on SmolLM2 KL 0.0045, top-1
0.968; benchmarks/numerics.py measures it). Float-format weights (F32, F16, BF16) keep
float32 activations.

`--activations bf16` rounds each linear's input AND the weights' values (the format's own,
as above) to bfloat16 and sums the products in float32 with AVX-512 BF16's dot product
(kernels/bf16_linear.cpp): twice the multiply-adds an instruction, so prefill and verify
forwards of 5+ tokens run up to 1.6x faster while a one-token step costs the same; any weight
format, still batch-invariant (docs/weight-formats.md, "bf16 activations", gives its closeness to float32).

`--activations amx` rounds the same values to bfloat16 and sums the products on AMX tiles
(kernels/amx_linear.cpp; Intel Xeons since Sapphire Rapids): the hardware's own summation, so
not bf16's bits, but batch-invariant the same way; a forward of 16 tokens costs 1.25-1.6x one
token (bf16: ~4x), a one-token step 1.1-1.25x bf16's.

Without the compiled kernels (no compiler), weights are dequantised to float32 at load and run
through F.linear: the same values, more memory, and no batch-invariance guarantee.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as WeightFormat
from gguf import quants
from torch import nn

from draftwise.errors import ConfigError
from draftwise.models import kernels as kernels_module
from draftwise.models.kernels import native_kernels

# `--quantize` name -> the block format it stores (both 32-weight blocks with float16 scales)
QUANTIZATIONS = {"int8": WeightFormat.Q8_0, "int4": WeightFormat.Q4_1}
# int4 mode keeps these in Q8_0: the output projection decides every token; in 4 bits it cost
# SmolLM2 12 points of top-1 agreement, in 8 bits one (llama.cpp's Q4_K_M keeps it at 6 bits).
INT4_KEEP_INT8 = ("lm_head",)
# Formats the kernel runs as they are; any other GGUF format is dequantised to float32 at load.
# The lattice formats (IQ1_S .. IQ3_S) are decoded a row at a time into floats (kernels/lattice.h).
LATTICE_FORMATS = frozenset(WeightFormat[name] for name in kernels_module.LATTICE_FORMATS)
NATIVE_FORMATS = frozenset({WeightFormat.F32, WeightFormat.F16, WeightFormat.BF16, WeightFormat.Q4_0,
                            WeightFormat.Q4_1, WeightFormat.Q5_0, WeightFormat.Q5_1, WeightFormat.Q8_0,
                            WeightFormat.Q2_K, WeightFormat.Q3_K, WeightFormat.Q4_K, WeightFormat.Q5_K,
                            WeightFormat.Q6_K, WeightFormat.IQ4_NL, WeightFormat.IQ4_XS}) | LATTICE_FORMATS
# What a linear's input is rounded to before it meets the weights; --activations also takes
# "auto" (default_activations chooses one of these).
SETTINGS = ("float32", "int8", "bf16", "amx", "int16")
ACTIVATIONS = ("auto", *SETTINGS)
# The kernel each setting runs (kernels/*_linear.cpp), and the code kernels.Decoder takes for it.
PRODUCTS = {"float32": "blocked_linear", "int8": "int8_linear", "int16": "int16_linear", "bf16": "bf16_linear",
            "amx": "amx_linear"}
ACTIVATION_CODES = {"float32": 0, "int8": 1, "bf16": 2, "amx": 3, "int16": 4}
# Block formats with an int8-activation path; the others keep float32 activations.
INT8_FORMATS = frozenset({WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.Q5_0, WeightFormat.Q5_1,
                          WeightFormat.Q8_0, WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K})
# Block formats with an int16-activation path (K-quants: a Q4_K_M, Q5_K_M or Q3_K_S/M/L file's, and
# IQ4_XS); the others (Q2_K among them) keep float32 activations.
INT16_FORMATS = frozenset({WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K, WeightFormat.Q3_K,
                           WeightFormat.IQ4_XS})


class BlockWeight(nn.Module):
    """num_rows rows of num_columns weights in `format`: bytes [num_rows, bytes per row]."""

    def __init__(self, data: torch.Tensor, format: WeightFormat, num_columns: int) -> None:
        super().__init__()
        if format not in NATIVE_FORMATS:  # e.g. TQ2_0: exact float32 values, 32 bits each
            data = _raw_bytes(dequantize(data, format, num_columns))
            format = WeightFormat.F32
        self.format = WeightFormat(format)
        self.num_columns = num_columns
        self.kernels = native_kernels(progress=False)
        self.activations = "float32"  # what matmul rounds x to: set by use_activations()
        if self.kernels is None:  # PyTorch ops need float32 values
            self.register_buffer("data", torch.empty(0, dtype=torch.uint8), persistent=False)
            self.register_buffer("dense", dequantize(data, format, num_columns), persistent=False)
        else:
            self.register_buffer("data", data.contiguous(), persistent=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, format: WeightFormat) -> "BlockWeight":
        """Store a float weight [rows, columns] in format (float32, bfloat16 or a block format)."""
        num_columns = weight.shape[1]
        if format == WeightFormat.F32:
            data = _raw_bytes(weight.detach().float().contiguous())
        elif format in (WeightFormat.BF16, WeightFormat.F16):
            dtype = torch.bfloat16 if format == WeightFormat.BF16 else torch.float16
            data = _raw_bytes(weight.detach().to(dtype).contiguous())
        else:
            block = quants.GGML_QUANT_SIZES[format][0]
            if num_columns % block:
                raise ConfigError(f"{format.name} stores rows in blocks of {block} weights; a layer has "
                                  f"{num_columns} columns: use --quantize int8 or no --quantize.")
            data = quantize_blocks(weight, format)
        return cls(data, format, num_columns)

    @property
    def num_rows(self) -> int:
        return (self.dense if self.kernels is None else self.data).shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, num_columns] float32
        if self.kernels is None:
            return F.embedding(ids, self.dense)
        return self.kernels.dequantize_rows(self.data, int(self.format), self.num_columns, ids)

    def matmul(self, x: torch.Tensor, activations: str | None = None) -> torch.Tensor:
        """x [T, num_columns] float32 -> [T, num_rows]; activations: this call's rounding of x
        instead of the weight's own setting (a drafter's choice by row count; None: its own)."""
        if self.kernels is None:
            return F.linear(x, self.dense)
        product = getattr(self.kernels, PRODUCTS[activations or self.activations])
        return product(x.contiguous(), self.data, int(self.format), self.num_columns)

    def extra_repr(self) -> str:
        rounded = "" if self.activations == "float32" else f", {self.activations} activations"
        return f"{self.num_rows}x{self.num_columns}, {self.format.name}{rounded}"


class BlockLinear(nn.Module):
    """y = x @ weight.T + bias, weight a BlockWeight (possibly shared with an embedding)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        out = self.weight.matmul(x)
        return out if self.bias is None else out.add_(self.bias)


class BlockEmbedding(nn.Module):
    """Token embeddings looked up row by row out of a BlockWeight [vocab, hidden]."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32
        return self.weight.rows(ids)


def quantize_blocks(weight: torch.Tensor, format: WeightFormat) -> torch.Tensor:
    """A float weight [rows, columns] -> its block bytes uint8 [rows, bytes], by gguf-py (the reference)."""
    return torch.from_numpy(quants.quantize(weight.detach().float().numpy(), format))


def dequantize(data: torch.Tensor, format: WeightFormat, num_columns: int) -> torch.Tensor:
    """Block bytes -> float32 [rows, num_columns], by gguf-py (the reference)."""
    if format == WeightFormat.F32:
        return data.view(torch.float32).reshape(-1, num_columns).clone()
    if format == WeightFormat.BF16:
        return data.view(torch.bfloat16).reshape(-1, num_columns).float()
    values = quants.dequantize(data.numpy(), format)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, num_columns)


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize={quantize!r} is not supported: use one of {', '.join(QUANTIZATIONS)}.")


def store_weights(module: nn.Module, format: WeightFormat, quantize: str | None = None) -> nn.Module:
    """Replace every nn.Linear and nn.Embedding under module by its BlockLinear / BlockEmbedding
    in format (or in quantize's block format), in place; returns module. A tied lm_head keeps
    sharing the embedding's weight."""
    check_quantize(quantize)
    stored: dict[tuple, BlockWeight] = {}  # a float tensor's storage -> its stored copy (tied weights)

    def store(name: str, weight: torch.Tensor) -> BlockWeight:
        chosen = format
        if quantize is not None:
            chosen = QUANTIZATIONS["int8" if quantize == "int4" and name in INT4_KEEP_INT8 else quantize]
        key = (weight.data_ptr(), tuple(weight.shape), chosen)
        if key not in stored:
            stored[key] = BlockWeight.from_float(weight, chosen)
        return stored[key]

    def replace(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, BlockLinear(store(name, child.weight), child.bias))
            elif isinstance(child, nn.Embedding):
                # Embeddings stay exact in quantize mode: a lookup reads one row, never the bytes.
                setattr(parent, name, BlockEmbedding(store(name, child.weight) if quantize is None
                                                     else BlockWeight.from_float(child.weight, format)))
            else:
                replace(child)

    replace(module)
    return module


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ConfigError(f"activations={activations!r} is not supported: use one of {', '.join(ACTIVATIONS)}.")


def default_activations(own_blocks: bool, formats: frozenset = frozenset()) -> str:
    """What activations="auto" means for a GGUF model's own blocks (--dtype auto, no --quantize):
    "amx" on a CPU with AMX tiles (Intel Xeons since Sapphire Rapids), else "bf16" on a CPU whose
    kernels use AVX-512 BF16's dot product, else "int16" where the blocks (`formats`) include
    K-quants (a Q4_K_M or Q5_K_M file) and the kernels have AVX2, else "float32"; "float32" for
    everything else
    (--dtype float32 / bfloat16, --quantize, the transformers fallback). Measured (README,
    "Defaults, and why"): on an AMD EPYC Zen 4, bf16 decodes Qwen2.5-Coder-1.5B's Q4_K_M blocks
    1.37x faster plain and `ngram` 1.57x faster than float32 activations, with logits close to
    float32's (top-1 agreement 0.9986, mean KL 1.2e-4 nats); on an AMX Xeon, SmolLM2's bench
    suite with `ngram` (the default drafter) ran 1.32x faster on AMX tiles than with bf16's dot
    product (faster on every category), plain decoding 0.98x; on an AMD EPYC Zen 3 (AVX2),
    int16 decodes Qwen2.5-Coder-1.5B's one-token step 1.4x faster than float32 activations and
    prefills ~1.1x faster, with logits ~360x closer to float32's than bf16's (mean KL 3.3e-7
    nats, top-1 0.9986). Speculation equals plain decoding in each."""
    kernels = native_kernels(progress=False)
    if not own_blocks or kernels is None:
        return "float32"
    if kernels.amx_in_hardware():
        return "amx"
    if kernels.bf16_dot_in_hardware():
        return "bf16"
    return "int16" if kernels.int16_dot_in_hardware() and formats & INT16_FORMATS else "float32"


def use_activations(module: nn.Module, activations: str) -> nn.Module:
    """Make every linear under module round its input to `activations` ("float32", "int8", "int16",
    "bf16" or "amx"); returns module. All but float32 need the compiled kernels; int8 also
    block-format weights (a GGUF file's own, or --quantize int8/int4), int16 K-quant blocks (a
    Q4_K_M or Q5_K_M file's): anything else is a ConfigError naming
    the fix, as is amx on a CPU without AMX tiles. bf16 on a CPU without AVX-512 BF16 runs the
    same arithmetic slower (one warning)."""
    check_activations(activations)
    if activations == "auto":
        raise ConfigError("use_activations needs a setting, not 'auto': pick float32, int8, int16, bf16 or amx "
                          "(loading.load resolves 'auto' through default_activations).")
    weights = [m for m in module.modules() if isinstance(m, BlockWeight)]
    if activations != "float32" and (not weights or weights[0].kernels is None):
        raise ConfigError(f"activations='{activations}' needs draftwise's compiled kernels and the native decoder; "
                          f"drop --activations {activations} (see the kernels' warning for how to build them).")
    if activations == "int8" and not any(w.format in INT8_FORMATS for w in weights):
        raise ConfigError("activations='int8' multiplies 8-bit activations with quantized blocks, and this "
                          "model's weights are all float: use --dtype auto on a GGUF model, or add --quantize "
                          "int8 / int4, or use --activations bf16.")
    if activations == "int16" and not any(w.format in INT16_FORMATS for w in weights):
        raise ConfigError("activations='int16' multiplies 16-bit activations with K-quant blocks (Q4_K, Q5_K, "
                          "Q6_K, Q3_K) and IQ4_XS's, and this model has none: use it on a Q4_K_M, Q5_K_M, Q3_K_M "
                          "or IQ4_XS GGUF model, or use --activations float32.")
    if activations == "amx" and not weights[0].kernels.amx_in_hardware():
        raise ConfigError("activations='amx' multiplies on AMX tiles, and this CPU (or its kernel) gives none: "
                          "AMX-BF16 is on Intel Xeons since Sapphire Rapids. Use --activations bf16 (the same "
                          "rounding, summed by AVX-512 BF16's dot product) or float32.")
    if activations == "bf16" and not weights[0].kernels.bf16_dot_in_hardware():
        warnings.warn("this CPU has no AVX-512 BF16 dot product (vdpbf16ps): --activations bf16 computes the same "
                      "values in float32 instructions, slower than float32 activations. Drop --activations bf16 "
                      "on this machine.", RuntimeWarning, stacklevel=2)
    integer_formats = {"int8": INT8_FORMATS, "int16": INT16_FORMATS}.get(activations)
    for weight in weights:
        # formats with no integer path of the setting's keep float32 activations under it
        weight.activations = "float32" if integer_formats and weight.format not in integer_formats else activations
    return module


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:  # [rows, columns] -> uint8 [rows, bytes], no copy
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
