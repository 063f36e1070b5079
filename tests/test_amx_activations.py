"""`--activations amx` (kernels/amx_linear.cpp): bf16_linear's rounding of x and the weights, the
products summed on AMX tiles. Where the CPU has tiles: every row of every weight format is
bit-identical whatever rows are beside it (1 to 120 rows, the decode and the prefill layouts),
within float32 rounding of bf16's dot products, and greedy speculation equals plain decoding on
the real SmolLM2. Where it has none: a clear refusal that names the fix. (The hypothesis
invariance test in tests/test_batch_invariance.py runs amx too where it can.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from draftwise.config import SamplingParams
from draftwise.drafters import NgramDrafter
from draftwise.drafters.eagle import EagleDrafter
from draftwise.engine import AMX_PREFILL_CHUNK, Engine
from draftwise.errors import ConfigError
from draftwise.heads import head_for
from draftwise.heads.eagle import load_head
from draftwise.models import loading
from draftwise.models.kernels import native_kernels
from draftwise.models.linear import BlockLinear, BlockWeight, use_activations
from tests.conftest import PROMPTS
from tests.test_kernels import CASES, kernels  # noqa: F401 (a fixture)


@pytest.mark.parametrize("format, make", CASES, ids=[format.name for format, _ in CASES])
def test_amx_rows_are_bit_identical_whatever_rows_are_beside_them(kernels, format, make):
    data, num_columns = make(format)
    weight = BlockWeight(data, format, num_columns)
    if not kernels.amx_in_hardware():
        with pytest.raises(ConfigError, match="--activations bf16"):
            use_activations(BlockLinear(weight), "amx")
        with pytest.raises(RuntimeError, match="AMX"):
            kernels.amx_linear(torch.randn(2, num_columns), data, int(format), num_columns)
        return
    weight.activations = "amx"
    torch.manual_seed(int(format))
    x = torch.randn(120, num_columns) * 3
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(120)])
    for group in (3, 16, 17, 25, 32, 33, 97, 120):  # 16: one tile of rows; 17-32: two (the pair layout); 33+: the prefill layout
        together = torch.cat([weight.matmul(x[i:i + group]) for i in range(0, 120, group)])
        assert torch.equal(together, alone), f"rows differ when computed {group} at a time"
    # past amx_linear's 512-row blocks (1,100 rows: three uneven blocks), the rows 100 at a time
    tall = torch.randn(1100, num_columns)
    assert torch.equal(weight.matmul(tall), torch.cat([weight.matmul(tall[i:i + 100]) for i in range(0, 1100, 100)]))
    # the same rounded products as bf16's dot products, summed in another order: float32 rounding apart
    weight.activations = "bf16"
    dot_products = weight.matmul(x)
    assert (alone - dot_products).abs().max() <= 1e-5 * dot_products.abs().max()


@pytest.mark.parametrize("format, make", CASES, ids=[format.name for format, _ in CASES])
def test_the_products_see_each_weight_rounded_to_bfloat16(kernels, format, make):
    """A one-hot row of x picks one column of the weights: each output is then one exact product,
    so y is the weights' own values rounded to bfloat16 (nearest even), as the decoders handed
    them to the products, in every layout (decode, pair, prefill) of the tiles and both of bf16's
    (in registers up to 8 rows, tiles beyond). Catches a decoder that rounds a table or a scale
    differently (the Q4_K word-permute tables, the scales built in a register)."""
    data, num_columns = make(format)
    weight = BlockWeight(data, format, num_columns)
    values = quants.dequantize(data.numpy(), format).reshape(weight.num_rows, num_columns)  # gguf-py's, not ours
    expected = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).bfloat16().float().T  # [columns, rows]
    torch.manual_seed(int(format) + 7)
    columns = torch.randperm(num_columns)[:97]
    one_hot = torch.eye(num_columns)[columns].contiguous()
    products = [("bf16", kernels.bf16_linear, (1, 8, 40))]
    if kernels.amx_in_hardware():
        products.append(("amx", kernels.amx_linear, (1, 16, 25, 97)))
    for activations, product, row_counts in products:
        for rows in row_counts:
            got = product(one_hot[:rows], data, int(format), num_columns)
            assert torch.equal(got, expected[columns[:rows]]), f"{activations}, {rows} rows: not the rounded weights"


GREEDY = SamplingParams(max_new_tokens=24)


def test_greedy_speculation_equals_plain_decoding_on_amx_tiles():
    if not native_kernels(progress=False).amx_in_hardware():
        with pytest.raises(ConfigError, match="AMX"):
            loading.load("smollm2-135m", auto_fetch=True, progress=False, activations="amx")
        return
    target = loading.load("smollm2-135m", auto_fetch=True, progress=False, activations="amx")
    plain = [Engine(target).generate(prompt, GREEDY).token_ids for prompt in PROMPTS]
    head = load_head(head_for("smollm2-135m", "eagle"), target.model)
    for drafter, num_draft_tokens in ((NgramDrafter(), 16), (EagleDrafter(head, target.model), 16)):
        engine = Engine(target, drafter, num_draft_tokens)
        results = [engine.generate(prompt, GREEDY) for prompt in PROMPTS]
        assert [result.token_ids for result in results] == plain
        assert sum(result.metrics.num_accepted_tokens for result in results) > 0


def test_a_long_prompt_on_tiles_prefills_in_chunks_and_generates_what_a_whole_prefill_does():
    target = loading.load("smollm2-135m", auto_fetch=True, progress=False)  # as generate loads it
    chunked = Engine(target, NgramDrafter(), 8)
    if target.activations != "amx":
        assert chunked.prefill_chunk is None  # bf16 / float32 prefill whole prompts (measured no faster)
        return
    assert chunked.prefill_chunk == AMX_PREFILL_CHUNK
    texts = [p if isinstance(p, str) else p[0]["content"] for p in PROMPTS]
    prompt = [{"role": "user", "content": "Summarise these notes:\n\n" + "\n\n".join(texts * 12)}]
    assert len(chunked.encode(prompt)) > 2 * AMX_PREFILL_CHUNK  # three forwards, the last one short
    whole = Engine(target, NgramDrafter(), 8)
    whole.prefill_chunk = None
    expected = whole.generate(prompt, GREEDY)
    result = chunked.generate(prompt, GREEDY)
    assert result.token_ids == expected.token_ids
    assert result.metrics.num_accepted_tokens > 0
