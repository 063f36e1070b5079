"""Linear-layer kernels for CPU decoding, swapped in once after loading.

A decode step multiplies a few rows (the last token plus k draft tokens) by every weight
matrix, so the kernels that matter are skinny matrix products, which are bound by how many
weight bytes they read. Measured on this project's 2-core CPU (Qwen2.5-1.5B shapes):

- float32: MKL's sgemm reads the weight once per 3 rows (`F.linear`: 11 rows cost 3.4x one
  row) or, on a transposed copy, costs 1.4x at 2 rows and 1.9x at 11. draftwise's own kernel
  (`SkinnyLinear`, kernels/skinny_linear.cpp) reads it once for any number of rows: a whole
  Qwen2.5-1.5B forward over 2 / 4 / 6 / 11 tokens costs 1.07x / 1.16x / 1.22x / 1.50x one
  token, against 1.72x / 1.69x / 1.89x / 2.09x with the transposed copy, and the same for one
  token (213 vs 227 ms). That gap is the price of verifying a draft. Where the kernel cannot be compiled,
  float32 models use the transposed copy (`TransposedLinear`). bfloat16 keeps `nn.Linear`.
- int8 / int4 weight-only (`--quantize`; int4 keeps the output projection in int8): PyTorch's own CPU kernels
  (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read 2x / 4x fewer bytes than
  bfloat16. They are fast with bfloat16 activations only, so quantized models compute in
  bfloat16.

Outputs of every kernel here match `F.linear` up to rounding (tests/test_quantize.py states
the tolerances); none of them changes what the model computes, only how fast.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.errors import ConfigError
from draftwise.models.skinny import Kernel, skinny_kernel

QUANTIZATIONS = ("int8", "int4")
# 32 input channels per int4 group: GGUF's Q4_K blocks are 32 wide, so weights dequantised
# from a Q4_K file re-quantize almost exactly (SmolLM2: mean KL to float32 0.045 at 32, 0.69
# at 64 whose groups straddle two blocks).
INT4_GROUP_SIZE = 32
# int4 mode keeps these in int8: the output projection (often tied to the embedding and
# stored at 6-8 bits in GGUF files) decides every token; in 4 bits it cost SmolLM2 12 points
# of top-1 agreement, in 8 bits one (llama.cpp's Q4_K_M keeps it at 6 bits too).
INT4_KEEP_INT8 = ("lm_head",)
# From this many rows on (a prefill), Int8Linear dequantises the weight and uses the bfloat16
# matmul: for an 8960x1536 weight and 330 rows, 5 ms dequantising + 22 ms (AMX) against 58 ms
# in the int8 kernel, which is built for a few rows. (For int4 no faster path was found:
# dequantising costs as much as its kernel.)
INT8_DEQUANTIZE_ROWS = 32


# Up to this many rows (a decode or verify step) SkinnyLinear uses its own kernel; more rows (a
# prefill) go to MKL's sgemm, which is compute-bound there and better at it.
SKINNY_MAX_ROWS = 16


class SkinnyLinear(nn.Module):
    """y = x @ weight.T + bias, weight [out, in] as stored: few rows through draftwise's
    kernel, many through MKL."""

    def __init__(self, linear: nn.Linear, kernel: Kernel) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if x.shape[0] > SKINNY_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = self.kernel(x.contiguous(), self.weight)
        return out if self.bias is None else out.add_(self.bias)


class TransposedLinear(nn.Module):
    """y = x @ weight_t + bias, weight_t [in, out] contiguous: fast skinny float32 products."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


class Int8Linear(nn.Module):
    """Weight-only int8: one symmetric scale per output channel, w ~= q * scale."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        # The kernel takes bfloat16 scales: round them first, then quantize against the rounded ones.
        scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(torch.bfloat16)  # [out]
        q = (weight / scales.float()[:, None]).round().clamp(-127, 127)
        self.register_buffer("weight", q.to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = _bfloat16_bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] bfloat16
        if x.shape[0] >= INT8_DEQUANTIZE_ROWS:
            return F.linear(x, self.weight.to(x.dtype) * self.scales[:, None], self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    """Weight-only int4, asymmetric per group of input channels: w ~= (q - 8) * scale + zero,
    q in 0..15, packed by PyTorch for its CPU kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        num_out, num_in = linear.weight.shape
        if num_out % 16:
            raise ConfigError(f"int4 needs output sizes divisible by 16; a layer has {num_out}: use --quantize int8.")
        self.group_size = INT4_GROUP_SIZE
        if num_in % self.group_size:
            raise ConfigError(f"int4 needs input sizes divisible by {self.group_size}; a layer has {num_in}: "
                              "use --quantize int8.")
        groups = linear.weight.detach().float().view(num_out, num_in // self.group_size, self.group_size)
        low = groups.amin(dim=-1, keepdim=True)
        scales = (groups.amax(dim=-1, keepdim=True) - low).clamp(min=1e-8) / 15.0  # [out, groups, 1]
        q = ((groups - low) / scales).round().clamp(0, 15).to(torch.int32).view(num_out, num_in)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        zeros = low + 8.0 * scales  # the kernel subtracts 8 from q
        # [groups, out, 2]: the kernel's layout for (scale, zero) pairs
        scales_and_zeros = torch.cat((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = _bfloat16_bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] bfloat16
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias


def _bfloat16_bias(linear: nn.Linear) -> nn.Parameter | None:
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)


def check_quantize(quantize: str | None, dtype: torch.dtype) -> None:
    if quantize is None:
        return
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize={quantize!r} is not supported: use one of {', '.join(QUANTIZATIONS)}.")
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"--quantize {quantize} computes in bfloat16 (PyTorch's CPU int8/int4 kernels are fast only "
            "there): use --dtype bfloat16 with it."
        )


def prepare_linears(module: nn.Module, dtype: torch.dtype, quantize: str | None = None,
                    progress: bool = True) -> nn.Module:
    """Replace every nn.Linear under module with the fastest kernel for dtype / quantize, in
    place; returns module. progress: say so when the float32 kernel is compiled (once)."""
    check_quantize(quantize, dtype)
    kernel = {"int8": Int8Linear, "int4": Int4Linear}.get(quantize)
    if kernel is None:
        if dtype != torch.float32:
            return module  # bfloat16: nn.Linear is already the fast path
        skinny = skinny_kernel(progress)
        kernel = TransposedLinear if skinny is None else functools.partial(SkinnyLinear, kernel=skinny)
    return _replace_linears(module, kernel, quantize)


def _replace_linears(module: nn.Module, kernel, quantize: str | None) -> nn.Module:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child) if quantize == "int4" and name in INT4_KEEP_INT8 else kernel(child))
        else:
            _replace_linears(child, kernel, quantize)
    return module
