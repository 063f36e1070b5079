"""Weight formats (models/linear.py): bfloat16 / Q8_0 / Q4_1 blocks compute close to the float
product, and int8 / int4 (`--quantize`: Q8_0 / Q4_1 blocks) keep the real model's logits close
to float32's; speculation on them equals their own plain greedy output by construction.

Tolerances, measured on SmolLM2-135M over the 12 test prompts (teacher forcing, every position)
and set with a margin, so a broken kernel (wrong scale, wrong packing, wrong group) fails them
by far while rounding passes:
- top-1 agreement with float32 (mean over prompts): bfloat16 0.987, int8 0.970, int4 0.983;
  asserted >= 0.93 for int8 and int4;
- mean KL(float32 || quantized) per position: bfloat16 0.0020, int8 0.0080, int4 0.0024;
  asserted < 0.03. (int4 with 64-wide groups, which straddle GGUF's 32-wide Q4_K blocks,
  measured 0.60 and 0.69: far outside.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftwise.engine import Engine
from draftwise.drafters import NgramDrafter
from draftwise.config import SamplingParams
from draftwise.errors import ConfigError
from draftwise.models import loading
from draftwise.models.linear import BlockLinear, BlockWeight, WeightFormat, store_weights
from tests.conftest import PROMPTS
from tests.test_model_parity import prompt_ids

# (min top-1 agreement, max mean KL) against float32, per format; see the module docstring
TOLERANCES = {"int8": (0.93, 0.03), "int4": (0.93, 0.03)}


def random_linear(num_in: int, num_out: int, bias: bool) -> nn.Linear:
    torch.manual_seed(num_in * 31 + num_out)
    return nn.Linear(num_in, num_out, bias=bias)


@pytest.mark.parametrize("format, max_relative_error", [(WeightFormat.Q8_0, 0.02), (WeightFormat.Q4_1, 0.2),
                                                        (WeightFormat.BF16, 0.01)])
def test_quantized_weights_approximate_the_float_product(format, max_relative_error):
    # Gaussian weights are a hard case for 4 bits (outliers widen each group's range).
    linear = random_linear(1536, 576, bias=True)
    x = torch.randn(6, 1536)
    reference = linear(x)
    out = BlockLinear(BlockWeight.from_float(linear.weight, format), linear.bias)(x)
    relative = (out - reference).norm() / reference.norm()
    assert relative < max_relative_error
    # ... and it is the weights that carry the error, not a lost bias or a transposed product
    assert relative > 1e-5


def test_block_formats_refuse_rows_that_are_not_whole_blocks():
    with pytest.raises(ConfigError, match="blocks of 32"):
        BlockWeight.from_float(random_linear(100, 64, bias=False).weight, WeightFormat.Q4_1)


def test_int4_keeps_the_output_projection_in_int8():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 64))
    model.add_module("lm_head", nn.Linear(64, 64))
    store_weights(model, WeightFormat.F32, "int4")
    assert model.proj.weight.format == WeightFormat.Q4_1 and model.lm_head.weight.format == WeightFormat.Q8_0


def test_quantize_needs_a_known_format():
    with pytest.raises(ConfigError, match="int3"):
        store_weights(nn.Linear(32, 32), WeightFormat.F32, "int3")
    with pytest.raises(ConfigError, match="int3"):
        loading.load("smollm2-135m", quantize="int3")


@pytest.fixture(scope="module")
def quantized_models():
    return {name: loading.load("smollm2-135m", dtype="float32", quantize=name, progress=False)
            for name in TOLERANCES}


def teacher_forced_logits(model, ids: torch.Tensor) -> torch.Tensor:  # [T, vocab]
    return model.forward(ids, torch.arange(ids.shape[0]), model.new_cache(ids.shape[0]))


@pytest.mark.parametrize("quantize", list(TOLERANCES))
def test_quantized_logits_stay_close_to_float32(smollm2, quantized_models, quantize):
    model = quantized_models[quantize].model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())  # every linear was replaced
    assert model.model.layers[0].mlp.up_proj.weight.format == {"int8": WeightFormat.Q8_0, "int4": WeightFormat.Q4_1}[quantize]
    min_agreement, max_kl = TOLERANCES[quantize]
    agreements, kls = [], []
    for prompt in PROMPTS:
        ids = prompt_ids(smollm2.tokenizer, prompt)
        reference = teacher_forced_logits(smollm2.model, ids)
        logits = teacher_forced_logits(model, ids)
        agreements.append((reference.argmax(-1) == logits.argmax(-1)).float().mean().item())
        kls.append(F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                            reduction="none").sum(-1).mean().item())
    assert sum(agreements) / len(agreements) >= min_agreement
    assert sum(kls) / len(kls) < max_kl


@pytest.mark.parametrize("quantize", list(TOLERANCES))
def test_speculation_on_a_quantized_target_equals_its_plain_greedy_output(quantized_models, quantize):
    target = quantized_models[quantize]
    params = SamplingParams(max_new_tokens=32)
    for prompt in PROMPTS[1:4]:
        plain = Engine(target).generate(prompt, params)
        ngram = Engine(target, NgramDrafter(), 5).generate(prompt, params)
        assert ngram.token_ids == plain.token_ids
