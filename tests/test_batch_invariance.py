"""Batch invariance on the real SmolLM2-135M, in every weight format: a position's logits are
bit-identical (torch.equal) whether it was scored alone, inside a k-token chain, inside a tree,
or inside a prefill. This is what makes greedy speculation equal plain greedy decoding by
construction, on any CPU, rather than by the luck of rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftwise.config import SamplingParams
from draftwise.drafters import ModelDrafter, NgramDrafter
from draftwise.drafters.eagle import EagleDrafter
from draftwise.drafters.history import HistoryDrafter, NgramHistory
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.heads import head_for
from draftwise.heads.eagle import load_head
from draftwise.heads.medusa import load_medusa
from draftwise.models import loading
from draftwise.models.base import Segment
from draftwise.models.kernels import native_kernels
from draftwise.models.linear import BlockLinear, use_activations
from tests.conftest import PROMPTS
from tests.test_model_parity import prompt_ids

# weight format name -> load arguments; "auto" runs SmolLM2's GGUF blocks (Q4_1, Q8_0) as shipped. Each
# names its activations: the default ("auto") depends on the CPU.
FORMATS = {"gguf": {"dtype": "auto", "activations": "float32"}, "float32": {"dtype": "float32"},
           "bfloat16": {"dtype": "bfloat16"},
           "int8": {"dtype": "float32", "quantize": "int8"}, "int4": {"dtype": "float32", "quantize": "int4"},
           "gguf-int8-activations": {"dtype": "auto", "activations": "int8"},
           "gguf-bf16-activations": {"dtype": "auto", "activations": "bf16"},
           # int16 activations run K-quant blocks only (SmolLM2 has none): the 0.5B's Q4_K, Q6_K
           "qwen-gguf-int16-activations": {"name": "qwen2.5-coder-0.5b", "dtype": "auto", "activations": "int16"}}
# AMX tiles run only where the CPU has them (elsewhere tests/test_amx_activations.py checks the refusal).
_KERNELS = native_kernels(progress=False)
if _KERNELS is not None and _KERNELS.amx_in_hardware():
    FORMATS["gguf-amx-activations"] = {"dtype": "auto", "activations": "amx"}


@pytest.fixture(scope="module", params=list(FORMATS))
def model(request):
    arguments = dict(FORMATS[request.param])
    return loading.load(arguments.pop("name", "smollm2-135m"), auto_fetch=True, progress=False, **arguments).model


def one_token_logits(model, tokens: torch.Tensor) -> torch.Tensor:  # [n] -> [n, vocab], one forward per token
    cache = model.new_cache(tokens.shape[0])
    return torch.cat([model.forward(tokens[i:i + 1], torch.tensor([i]), cache) for i in range(tokens.shape[0])])


def tree_around(chain: torch.Tensor, extra_parents: list[int], vocab_size: int, seed: int):
    """A draft tree holding `chain` as one path, with extra random nodes hung off its nodes
    (parents[i] = index of the parent node, -1 = the last committed token). Returns tokens,
    depths, the ancestor mask [n, n] and the chain's node indices."""
    generator = torch.Generator().manual_seed(seed)
    tokens, parents, chain_nodes = [], [], []
    for index, token in enumerate(chain.tolist()):
        if index < len(extra_parents):  # a sibling branch before each chain node
            attach = extra_parents[index] % (index + 1) - 1  # -1 .. index - 1 along the chain so far
            tokens.append(int(torch.randint(vocab_size, (1,), generator=generator)))
            parents.append(chain_nodes[attach] if attach >= 0 else -1)
        parents.append(chain_nodes[-1] if chain_nodes else -1)
        tokens.append(token)
        chain_nodes.append(len(tokens) - 1)
    num_nodes = len(tokens)
    mask = torch.eye(num_nodes, dtype=torch.bool)
    depths = []
    for node in range(num_nodes):
        ancestor, depth = parents[node], 0
        while ancestor != -1:
            mask[node, ancestor] = True
            ancestor, depth = parents[ancestor], depth + 1
        depths.append(depth)
    return torch.tensor(tokens), torch.tensor(depths), mask, chain_nodes


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_prompt=st.integers(2, 24), num_draft=st.integers(1, 16), seed=st.integers(0, 2**16),
       extra_parents=st.lists(st.integers(0, 100), max_size=6))
def test_logits_do_not_depend_on_what_else_the_forward_holds(model, num_prompt, num_draft, seed, extra_parents):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(model.info.vocab_size, (num_prompt + num_draft,), generator=generator)
    alone = one_token_logits(model, tokens)  # [n, vocab]

    # a prefill of everything at once
    prefill = model.forward(tokens, torch.arange(tokens.shape[0]), model.new_cache(tokens.shape[0]))
    assert torch.equal(prefill, alone)

    # a prompt prefill, then the draft as one k-token chain
    cache = model.new_cache(tokens.shape[0] + 16)
    model.forward(tokens[:num_prompt], torch.arange(num_prompt), cache)
    chain = model.forward(tokens[num_prompt:], torch.arange(num_prompt, tokens.shape[0]), cache)
    assert torch.equal(chain, alone[num_prompt:])

    # the same draft as one path of a tree with sibling branches (tree mask, per-node positions)
    cache.truncate(num_prompt)
    tree_tokens, depths, mask, chain_nodes = tree_around(tokens[num_prompt:], extra_parents, model.info.vocab_size, seed)
    tree = model.forward(tree_tokens, num_prompt + depths, cache, attn_mask=mask)
    assert torch.equal(tree[chain_nodes], alone[num_prompt:])


def batched_forward(model, compiled: bool) -> tuple[list, list]:
    """One forward over three sequences (a prefill, a chain after a prefix, a tree after a prefix)
    with hidden states, through kernels.Decoder (compiled) or the modules one by one."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.info.vocab_size, (40,), generator=generator)
    caches = [model.new_cache(48) for _ in range(3)]
    model.compiled_layers = compiled
    try:
        for cache in caches[1:]:
            model.forward(tokens[:12], torch.arange(12), cache)
        tree_tokens, depths, mask, _ = tree_around(tokens[12:17], [3, 1, 4], model.info.vocab_size, seed=1)
        segments = [Segment(tokens[:20], torch.arange(20), caches[0]),
                    Segment(tokens[12:18], torch.arange(12, 18), caches[1]),
                    Segment(tree_tokens, 12 + depths, caches[2], mask)]
        results = model.forward_batch(segments, hidden_layers=(0, 5, model.shape.num_layers))
    finally:
        model.compiled_layers = True
    return results, caches


def test_the_compiled_layers_compute_the_modules_bits(model):
    # kernels.Decoder runs every layer in one call; the modules, one kernel call at a time, are
    # its reference: logits, hidden states and the keys / values cached must be the same bits.
    compiled, compiled_caches = batched_forward(model, compiled=True)
    modules, module_caches = batched_forward(model, compiled=False)
    assert model._decoder is not None  # the compiled path really ran
    for (logits, hidden), (expected_logits, expected_hidden) in zip(compiled, modules):
        assert torch.equal(logits, expected_logits) and torch.equal(hidden, expected_hidden)
    for cache, expected in zip(compiled_caches, module_caches):
        assert cache.length == expected.length
        written = slice(0, cache.length)  # slots past it were never written (KVCache is not zeroed)
        assert torch.equal(cache.keys[:, :, :, written], expected.keys[:, :, :, written])
        assert torch.equal(cache.values[:, :, :, written], expected.values[:, :, :, written])


@pytest.mark.parametrize("activations", ["float32"] + [name for name in ("amx",) if "gguf-amx-activations" in FORMATS])
def test_the_compiled_layers_add_the_biases(qwen_0_5b, activations):  # Qwen2's q, k, v projections have biases
    # On AMX tiles the compiled layers run q, k and v (and gate, up) as one call (amx_linears).
    use_activations(qwen_0_5b.model, activations)
    try:
        compiled, _ = batched_forward(qwen_0_5b.model, compiled=True)
        modules, _ = batched_forward(qwen_0_5b.model, compiled=False)
    finally:
        use_activations(qwen_0_5b.model, "float32")
    assert qwen_0_5b.model.model.layers[0].self_attn.q_proj.bias is not None
    for (logits, hidden), (expected_logits, expected_hidden) in zip(compiled, modules):
        assert torch.equal(logits, expected_logits) and torch.equal(hidden, expected_hidden)


def test_the_compiled_layers_follow_a_change_of_activations():
    # use_activations after a forward switches the linears to int8: the compiled decoder must be
    # rebuilt with them, not keep running float32 activations.
    model = loading.load("smollm2-135m", auto_fetch=True, progress=False, activations="float32").model
    float32_results, _ = batched_forward(model, compiled=True)
    use_activations(model, "int8")
    int8_results, _ = batched_forward(model, compiled=True)
    modules, _ = batched_forward(model, compiled=False)
    for (logits, _), (float32_logits, _), (expected, _) in zip(int8_results, float32_results, modules):
        assert torch.equal(logits, expected) and not torch.equal(logits, float32_logits)


@pytest.fixture(scope="module")
def default_target():
    """SmolLM2 as `draftwise generate` loads it: --dtype auto, its GGUF blocks (Q4_1, Q8_0), and
    --activations auto: amx on a CPU with AMX tiles (the AMX Intels), else bf16 where the CPU has
    AVX-512 BF16 (the AMD EPYCs), else float32 (e.g. an Ice Lake Xeon)."""
    target = loading.load("smollm2-135m", auto_fetch=True, progress=False)
    assert target.model.model.layers[0].mlp.down_proj.weight.format.name == "Q4_1"
    return target


def test_the_default_activations_follow_the_cpu_on_a_gguf_models_own_blocks(default_target, smollm2_dense):
    kernels = native_kernels(progress=False)
    # SmolLM2's blocks (Q4_1, Q8_0) have no int16 path, so no CPU gives them int16 by default
    expected = ("amx" if kernels.amx_in_hardware() else "bf16" if kernels.bf16_dot_in_hardware() else "float32")
    assert default_target.activations == expected
    assert {m.weight.activations for m in default_target.model.modules() if isinstance(m, BlockLinear)} == {expected}
    assert smollm2_dense.activations == "float32"  # --dtype float32 keeps float32 arithmetic
    assert {m.weight.activations for m in smollm2_dense.model.modules() if isinstance(m, BlockLinear)} == {"float32"}
    with pytest.raises(ConfigError, match="not 'auto'"):
        use_activations(smollm2_dense.model, "auto")


def test_k_quant_blocks_default_to_int16_activations_where_avx2_is_the_best_the_cpu_has():
    from draftwise.models.linear import WeightFormat, default_activations

    kernels = native_kernels(progress=False)
    best = "amx" if kernels.amx_in_hardware() else "bf16" if kernels.bf16_dot_in_hardware() else None
    k_quants, blocks32 = frozenset({WeightFormat.Q4_K, WeightFormat.Q6_K}), frozenset({WeightFormat.Q4_1})
    assert default_activations(True, k_quants) == (best or ("int16" if kernels.int16_dot_in_hardware() else "float32"))
    assert default_activations(True, blocks32) == (best or "float32")
    assert default_activations(False, k_quants) == "float32"  # --dtype float32 / --quantize keep float32


def test_the_kv_cache_is_bfloat16_where_the_activations_are_rounded_unless_told(default_target, smollm2_dense):
    rounded = default_target.activations != "float32"
    assert default_target.kv_cache == ("bf16" if rounded else "float32")
    assert default_target.model.new_cache(4).keys.dtype == (torch.bfloat16 if rounded else torch.float32)
    assert smollm2_dense.kv_cache == "float32" and smollm2_dense.model.new_cache(4).values.dtype == torch.float32
    told = loading.load("smollm2-135m", progress=False, activations="float32", kv_cache="bf16")
    assert told.kv_cache == "bf16" and told.model.truncated(3).new_cache(4).keys.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache='fp8' is not supported: use one of auto, float32, bf16"):
        loading.load("smollm2-135m", progress=False, kv_cache="fp8")


GREEDY = SamplingParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def default_plain_outputs(default_target) -> list[list[int]]:
    return [Engine(default_target).generate(prompt, GREEDY).token_ids for prompt in PROMPTS]


def default_drafter(name: str, target):
    model = target.model
    if name == "ngram":
        return NgramDrafter()
    if name == "history":  # one history for the 12 prompts: each drafts from the answers before it
        return HistoryDrafter(NgramHistory())
    if name == "model":
        return ModelDrafter(model.truncated(27))
    if name == "eagle":  # trees: top 8 children, 6 deep
        return EagleDrafter(load_head(head_for("smollm2-135m", "eagle"), model), model, top_k=8, depth=6)
    return MedusaDrafter(load_medusa(head_for("smollm2-135m", "medusa"), model), model, top_k=6, beam=12)


# (The float32 tests in test_greedy_equality.py and test_heads.py cover more k; with float32
# activations the default blocks compute the float32 path's logits bit for bit, the last test here.)
# k: most draft tokens (tree nodes for eagle and medusa); the 27-layer draft model runs 8 only (CI's
# time: its forwards are the slowest drafter's; the other three cover one-token and 16-token drafts).
@pytest.mark.parametrize(("drafter", "num_draft_tokens"),
                         [(name, k) for name in ("ngram", "history", "model", "eagle", "medusa") for k in (1, 8, 16)
                          if name != "model" or k == 8])
def test_greedy_speculation_equals_plain_decoding_in_the_default_format(default_target, default_plain_outputs,
                                                                        drafter, num_draft_tokens):
    engine = Engine(default_target, default_drafter(drafter, default_target), num_draft_tokens)
    results = [engine.generate(prompt, GREEDY) for prompt in PROMPTS]
    assert [result.token_ids for result in results] == default_plain_outputs
    assert sum(result.metrics.num_accepted_tokens for result in results) > 0  # speculation really happened


def test_the_gguf_blocks_with_float32_activations_compute_the_float32_paths_logits(smollm2, smollm2_dense):
    # SmolLM2's blocks dequantise exactly to the float32 path's weights (gguf-py's arithmetic),
    # and both run the same kernel arithmetic: the logits are the same bits, in a prefill, a
    # 3-token verify after it and a one-token step. The suite's `smollm2` (the blocks, for speed)
    # stands for `--dtype float32` on the strength of this test.
    assert smollm2.model.model.layers[0].mlp.down_proj.weight.format.name == "Q4_1"
    assert smollm2_dense.model.model.layers[0].mlp.down_proj.weight.format.name == "F32"
    for prompt in PROMPTS:
        ids = prompt_ids(smollm2.tokenizer, prompt)
        assert torch.equal(stepped_logits(smollm2.model, ids), stepped_logits(smollm2_dense.model, ids)), \
            f"prompt {prompt!r}"


def stepped_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ids as the engine computes them: a prefill, a 3-token verify, a one-token step."""
    n = ids.shape[0]
    cache = model.new_cache(n)
    return torch.cat([model.forward(ids[:n - 4], torch.arange(n - 4), cache),
                      model.forward(ids[n - 4:n - 1], torch.arange(n - 4, n - 1), cache),
                      model.forward(ids[n - 1:], torch.arange(n - 1, n), cache)])


# 32-weight blocks (SmolLM2); Q4_K, Q6_K, Q5_0 (the 0.5B). Rounded activations store keys and values
# in bfloat16 by default (int16's, in float32); float32 activations over a bfloat16 cache is the
# remaining combination.
@pytest.mark.parametrize(("name", "activations", "kv_cache"),
                         [(name, activations, "auto") for name in ("smollm2-135m", "qwen2.5-coder-0.5b")
                          for activations in ("int8", "bf16")] + [("smollm2-135m", "float32", "bf16"),
                                                                  ("qwen2.5-coder-0.5b", "int16", "auto")])
def test_greedy_speculation_equals_plain_decoding_with_rounded_activations(name, activations, kv_cache):
    target = loading.load(name, auto_fetch=True, progress=False, activations=activations, kv_cache=kv_cache)
    expected_cache = torch.float32 if activations == "int16" else torch.bfloat16
    assert target.model.new_cache(1).keys.dtype == expected_cache
    prompts = PROMPTS if name == "smollm2-135m" else PROMPTS[:2]  # the 0.5B: CI budget
    plain = [Engine(target).generate(prompt, GREEDY).token_ids for prompt in prompts]
    engine = Engine(target, NgramDrafter(), 8)
    results = [engine.generate(prompt, GREEDY) for prompt in prompts]
    assert [result.token_ids for result in results] == plain
    assert sum(result.metrics.num_accepted_tokens for result in results) > 0
