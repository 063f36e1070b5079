"""A GGUF file with Q5_K, Q3_K, Q2_K, IQ4_XS and IQ4_NL matrices (the main formats of Q5_K_M,
Q3_K_S/M/L, Q2_K and IQ4_XS files) and the lattice formats below 4 bits (IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: IQ1/IQ2/IQ3 files') runs its blocks as shipped.

None of the packaged models holds any, so the file here is SmolLM2-135M's own with its 30 down
projections (1536 columns, whole 256-weight blocks; its other matrices have 576 columns, which
llama.cpp too keeps out of 256-weight formats) re-quantised from their Q4_1 values, layer i's to
Q5_K, Q3_K, Q2_K or IQ4_XS as i % 4 is 0, 1, 2 or 3, but layers 4-10's to one lattice format each
(random lattice points at the replaced blocks' scale: tests/lattice.py, as nothing here writes
these formats), its up projections (576 columns) to IQ4_NL (as an IQ4_XS file stores such rows),
and everything else copied: real weights, read as a user's file would be."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants

from draftwise.config import SamplingParams
from draftwise.drafters import NgramDrafter
from draftwise.engine import Engine
from draftwise.models import loading, registry
from draftwise.models.gguf_weights import dequantised_note, read_blocks
from draftwise.models.linear import WeightFormat, default_activations
from tests.conftest import PROMPTS
from tests.gguf_copy import copy_gguf
from tests.iq4 import quantize_iq4_nl, quantize_iq4_xs
from tests.lattice import LATTICE_FORMATS, random_blocks_like
from tests.q2k import quantize_q2_k
from tests.q3k import quantize_q3_k
from tests.q5k import quantize_q5_k
from tests.test_batch_invariance import one_token_logits, stepped_logits
from tests.test_model_parity import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
# layer i's down projection: DOWN_FORMATS[i % 4], but layers 4-10's LATTICE_FORMATS[i - 4]
LATTICE_LAYERS = range(4, 4 + len(LATTICE_FORMATS))
DOWN_FORMATS = [(quantize_q5_k, WeightFormat.Q5_K), (quantize_q3_k, WeightFormat.Q3_K),
                (quantize_q2_k, WeightFormat.Q2_K), (quantize_iq4_xs, WeightFormat.IQ4_XS)]


def write_with_q5k_down_projections(source: Path, path: Path) -> None:
    """source's metadata and tensors into path, each ffn_down matrix re-quantised to Q5_K, Q3_K, Q2_K
    or IQ4_XS by its layer and each ffn_up to IQ4_NL."""

    def requantised(name: str, data: np.ndarray, format):
        if not name.endswith(("ffn_down.weight", "ffn_up.weight")):
            return data, format
        layer = int(name.split(".")[1])
        if "ffn_down" in name and layer in LATTICE_LAYERS:
            lattice = LATTICE_FORMATS[layer - LATTICE_LAYERS.start]
            return random_blocks_like(quants.dequantize(data, format), lattice, np.random.default_rng(layer)), lattice
        quantize, new_format = (quantize_iq4_nl, WeightFormat.IQ4_NL) if "ffn_up" in name else DOWN_FORMATS[
            layer % len(DOWN_FORMATS)]
        return quantize(quants.dequantize(data, format)), new_format

    copy_gguf(source, path, tensor=requantised)


@pytest.fixture(scope="module")
def q5k_file(tmp_path_factory) -> Path:
    loading.resolve("smollm2-135m", auto_fetch=True, progress=False)
    path = tmp_path_factory.mktemp("q5k") / "smollm2-135m-q5k.gguf"
    write_with_q5k_down_projections(registry.gguf_path("smollm2-135m"), path)
    # Its config, tokenizer and --dtype float32 weights (517 MB) beside it, not in the user's
    # cache, where every run's new file would leave another copy.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "_converted_folder_for", lambda gguf_file: gguf_file.parent / "converted")
        yield path


def test_a_q5k_file_runs_its_blocks_with_the_same_bits_as_its_dequantised_weights(q5k_file):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "dequantised to float32" warning
        blocks = loading.load(str(q5k_file), activations="float32", kv_cache="float32", progress=False)
    layers = blocks.model.model.layers
    assert [layer.mlp.down_proj.weight.format for layer in layers[:4]] == [format for _, format in DOWN_FORMATS]
    assert [layers[i].mlp.down_proj.weight.format for i in LATTICE_LAYERS] == list(LATTICE_FORMATS)
    assert layers[0].mlp.up_proj.weight.format == WeightFormat.IQ4_NL
    # --dtype float32: transformers dequantises the file with gguf-py; the kernels' decode and
    # dequantised paths compute the same bits (a prefill, a 3-token verify, a one-token step).
    dense = loading.load(str(q5k_file), dtype="float32", progress=False)
    assert dense.model.model.layers[0].mlp.down_proj.weight.format == WeightFormat.F32
    for prompt in PROMPTS[:6]:
        ids = prompt_ids(blocks.tokenizer, prompt)
        assert torch.equal(stepped_logits(blocks.model, ids), stepped_logits(dense.model, ids)), f"prompt {prompt!r}"


# int8 and int16 (Q5_K's integer dot products: int16's in registers as its Q4_K's; int16's for
# Q3_K and IQ4_XS too, beside the other formats' float32, Q2_K's and IQ4_NL's among them; int8's
# beside float32 for all four), and the CPU's default where it rounds (amx
# on an AMX Xeon, bf16 with AVX-512 BF16): both round the decoded floats of any block format.
ACTIVATIONS = list(dict.fromkeys(["float32", "int8", "int16", default_activations(own_blocks=True)]))


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_a_q5k_models_rows_do_not_depend_on_the_rows_beside_them_and_speculation_equals_plain(q5k_file, activations):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # bf16 without AVX-512 BF16 says it is slower
        target = loading.load(str(q5k_file), activations=activations, progress=False)
    down = target.model.model.layers[0].mlp.down_proj.weight
    assert down.activations == activations
    if activations == "int16":  # Q3_K and IQ4_XS have int16 paths, Q2_K none (float32 activations)
        assert [layer.mlp.down_proj.weight.activations for layer in target.model.model.layers[1:4]] == \
            ["int16", "float32", "int16"]
    model = target.model
    tokens = torch.randint(model.info.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    alone = one_token_logits(model, tokens)
    assert torch.equal(model.forward(tokens, torch.arange(20), model.new_cache(20)), alone)
    cache = model.new_cache(24)
    model.forward(tokens[:8], torch.arange(8), cache)
    assert torch.equal(model.forward(tokens[8:], torch.arange(8, 20), cache), alone[8:])
    prompts = PROMPTS[:4]
    plain = [Engine(target).generate(prompt, GREEDY).token_ids for prompt in prompts]
    results = [Engine(target, NgramDrafter(), 8).generate(prompt, GREEDY) for prompt in prompts]
    assert [result.token_ids for result in results] == plain
    assert sum(result.metrics.num_accepted_tokens for result in results) > 0


def test_formats_the_kernels_do_not_run_as_blocks_are_named_with_their_cost_and_the_fix(q5k_file):
    tensors = read_blocks(q5k_file, "llama", 9, 3)
    assert dequantised_note(q5k_file, tensors) is None  # Q5_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL, Q4_1, Q8_0: all native
    name = "model.layers.0.mlp.down_proj.weight"
    data, _, columns = tensors[name]
    tensors[name] = (data, WeightFormat.TQ2_0, columns)  # as a ternary (BitNet) file's would read
    note = dequantised_note(q5k_file, tensors)
    assert note is not None and "1 of its 211 weight matrices are TQ2_0" in note
    assert f"{576 * 1536 * 4 / 2**20:,.0f} MB in memory" in note and "Q5_K_M" in note
