"""The EAGLE head and the Medusa heads shipped for SmolLM2-135M: greedy speculation with their
trees (and chains) equals plain greedy decoding on the 12 core prompts, sampling through the
trees stays exact, and they really draft (tokens committed per forward well above one).
tests/test_train.py trains both kinds and checks what it wrote."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace

import pytest
import torch

from draftwise import tree
from draftwise.config import SamplingParams, SpecConfig
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters import build_drafter
from draftwise.drafters.eagle import EagleDrafter, compact_copy
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.heads import SHIPPED, head_for
from draftwise.heads.eagle import FORMAT_VERSION, EagleConfig, EagleHead, load_head, read_head_files
from draftwise.heads.medusa import load_medusa
from tests.conftest import PROMPTS

PARAMS = SamplingParams(max_new_tokens=24)
# Measured with the shipped heads on these prompts (24 tokens each, 16-node drafts), tokens per
# forward: eagle 2.39 (tree) and 2.08 (chain) on an AMD EPYC Zen 3 in float32 activations (the head
# before it 2.21 and 2.09 there), medusa 1.52 and 1.29 (from its Q8_0 copy; 1.53 and 1.29 in
# float32). The floors leave ~10%.
EAGLE_MIN_TOKENS_PER_FORWARD = {"tree": 2.1, "chain": 1.9}
MEDUSA_MIN_TOKENS_PER_FORWARD = {"tree": 1.35, "chain": 1.15}


@pytest.fixture(scope="module")
def plain_outputs(smollm2) -> list[list[int]]:
    engine = Engine(smollm2)
    return [engine.generate(prompt, PARAMS).token_ids for prompt in PROMPTS]


def tokens_per_forward_if_equal(engine: Engine, plain_outputs: list[list[int]]) -> float:
    """Greedy speculation on the 12 prompts: every output must equal plain decoding's; returns the
    tokens committed per target forward (well above plain decoding's 1.0: the head really drafts)."""
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    for prompt, result, expected in zip(PROMPTS, results, plain_outputs):
        assert result.token_ids == expected, f"prompt {prompt!r}"
    return sum(r.metrics.num_committed_tokens for r in results) / sum(r.metrics.num_target_forwards for r in results)


@pytest.fixture(scope="module")
def eagle_head(smollm2):
    return load_head(head_for("smollm2-135m", "eagle"), smollm2.model)


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_eagle_speculation_equals_plain_greedy(smollm2, plain_outputs, eagle_head, shape):
    # top_k=1: one child per node, a chain drawn through the same tree path. Every level grown
    # (min_path_probability 0) and no prompt lookup, so the floors measure the head alone.
    drafter = EagleDrafter(eagle_head, smollm2.model, top_k=1 if shape == "chain" else 8, depth=6,
                           min_path_probability=0.0, lookup=0)
    engine = Engine(smollm2, drafter, num_draft_tokens=16)
    assert tokens_per_forward_if_equal(engine, plain_outputs) > EAGLE_MIN_TOKENS_PER_FORWARD[shape]


@pytest.fixture(scope="module")
def medusa_heads(smollm2):
    return load_medusa(head_for("smollm2-135m", "medusa"), smollm2.model)


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_medusa_speculation_equals_plain_greedy(smollm2, plain_outputs, medusa_heads, shape):
    # chain: each head's best token only (top_k=1, beam 1); tree: their top candidates combined.
    # No prompt lookup, so the floors measure the heads alone.
    drafter = MedusaDrafter(medusa_heads, smollm2.model, top_k=1 if shape == "chain" else 6,
                            beam=1 if shape == "chain" else 12, lookup=0)
    engine = Engine(smollm2, drafter, num_draft_tokens=16)
    assert tokens_per_forward_if_equal(engine, plain_outputs) > MEDUSA_MIN_TOKENS_PER_FORWARD[shape]


def test_medusa_with_the_adaptive_policy_and_sampling(smollm2, plain_outputs):
    # `--drafter medusa` with no --head: the shipped heads, the adaptive policy choosing the tree size.
    spec = SpecConfig(drafter="medusa")
    engine = Engine(smollm2, build_drafter(spec, smollm2), spec.max_draft_tokens, DraftLengthPolicy())
    for prompt, expected in zip(PROMPTS[:6], plain_outputs[:6]):
        assert engine.generate(prompt, PARAMS).token_ids == expected
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=1, seed=5)  # top_k=1: greedy's tokens
    for prompt, expected in zip(PROMPTS[6:9], plain_outputs[6:9]):
        assert engine.generate(prompt, sampled).token_ids == expected


def test_eagle_with_the_adaptive_policy_equals_plain_greedy(smollm2, plain_outputs):
    spec = SpecConfig(drafter="eagle")
    engine = Engine(smollm2, build_drafter(spec, smollm2), spec.max_draft_tokens, DraftLengthPolicy())
    for prompt, expected in zip(PROMPTS, plain_outputs):
        assert engine.generate(prompt, PARAMS).token_ids == expected


def test_sampling_through_eagle_trees_with_top_k_one_is_greedy(smollm2, plain_outputs, eagle_head):
    engine = Engine(smollm2, EagleDrafter(eagle_head, smollm2.model), 16)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=1, seed=3)
    for prompt, expected in zip(PROMPTS[:4], plain_outputs[:4]):
        assert engine.generate(prompt, params).token_ids == expected


def test_seeded_sampling_through_eagle_trees_is_reproducible(smollm2, eagle_head):
    engine = Engine(smollm2, EagleDrafter(eagle_head, smollm2.model), 16)
    params = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9, seed=11)
    assert engine.generate(PROMPTS[0], params).token_ids == engine.generate(PROMPTS[0], params).token_ids


def test_the_compiled_head_layer_computes_what_its_modules_compute(smollm2, eagle_head):
    """The drafter runs the head's layer through kernels.Decoder (drafters/eagle.compiled_layer);
    without the kernels its PyTorch modules run. Both must give the same rows: over committed
    context (causal), then a tree level whose rows see only their own ancestors among the draft
    rows already in the head's cache (a mask reaching back over them). Both read float32
    activations here: with int8 ones (the drafter's), an input that lands a hair apart in the two
    paths may round to another 8-bit level, which moves an output by up to a level's worth (a new
    head's rows differed by 2.5e-3 of their largest value that way)."""
    from draftwise.drafters.eagle import _CAUSAL, compiled_layer
    from draftwise.models.linear import use_activations

    compiled = EagleDrafter(eagle_head, smollm2.model)
    modules = EagleDrafter(eagle_head, smollm2.model)
    for drafter in (compiled, modules):
        use_activations(drafter.head, "float32")
        drafter.wide = drafter.wide_layer = None  # float32 at every row count (no AMX tiles past WIDE_ROWS)
    compiled.layer, modules.layer = compiled_layer(compiled.head), None
    assert compiled.layer is not None
    torch.manual_seed(0)
    hidden = eagle_head.config.hidden_size
    committed, level_1, level_2 = torch.randn(6, hidden), torch.randn(2, hidden), torch.randn(2, hidden)
    ancestors = torch.tensor([[True, False, True, False], [False, True, False, True]])  # 7 <- 9, 8 <- 10

    def rows(drafter: EagleDrafter, mask: torch.Tensor) -> list[torch.Tensor]:
        drafter.begin(SamplingParams(), torch.Generator(), 64)
        return [EagleDrafter._run([drafter], committed, torch.arange(100, 106), torch.arange(1, 7), [0], [6], [_CAUSAL]),
                EagleDrafter._run([drafter], level_1, torch.tensor([7, 8]), torch.tensor([7, 7]), [6], [2],
                                  [torch.eye(2, dtype=torch.bool)]),
                EagleDrafter._run([drafter], level_2, torch.tensor([9, 10]), torch.tensor([8, 8]), [8], [2], [mask])]

    for got, expected in zip(rows(compiled, ancestors), rows(modules, ancestors)):
        assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    # The mask matters: rows that also see the other branch come out otherwise.
    assert (rows(compiled, ancestors)[2] - rows(compiled, torch.ones(2, 4, dtype=torch.bool).tril(2))[2]).abs().max() > 1e-3


def _contexts_and_hidden_states(smollm2, hidden_layers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three prompts, each with the target's first token after it, and the target's hidden
    states of the prompt's rows (what a head has read when it first drafts)."""
    model = smollm2.model
    contexts, hiddens = [], []
    for prompt in ("Shopping list:\n1. eggs\n2. milk\n3.", "def fibonacci(n):\n    if n < 2:",
                   "The capital of France is Paris. The capital of Italy is"):
        ids = torch.tensor(smollm2.tokenizer.encode(prompt))
        logits, hidden = model.forward(ids, torch.arange(ids.shape[0]), model.new_cache(64), hidden_layers=hidden_layers)
        contexts.append(torch.cat((ids, logits[-1].argmax().view(1))))
        hiddens.append(hidden)
    return contexts, hiddens


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_forks_drafting_together_propose_the_trees_each_grows_alone(smollm2, eagle_head, medusa_heads, kind):
    """A batch's requests draft together (propose_together): EAGLE runs one head forward a level
    for all of them, each request's rows in its own head cache; Medusa one pass of its heads over
    every request's hidden state. With the heads' rows computed alike at every row count (EAGLE:
    float32 activations, no AMX tiles past WIDE_ROWS), each request gets, node for node, the tree
    it grows alone."""
    from draftwise.drafters.base import fork_drafter
    from draftwise.models.linear import use_activations

    if kind == "eagle":
        drafter = EagleDrafter(eagle_head, smollm2.model)
        use_activations(drafter.head, "float32")
        drafter.wide = drafter.wide_layer = None
    else:
        drafter = MedusaDrafter(medusa_heads, smollm2.model)
    contexts, hiddens = _contexts_and_hidden_states(smollm2, drafter.hidden_layers)

    def forks() -> list:
        out = [fork_drafter(drafter) for _ in contexts]
        for fork, hidden in zip(out, hiddens):
            fork.begin(SamplingParams(), torch.Generator(), 128)
            fork.observe(hidden)
        return out

    together = type(drafter).propose_together(forks(), contexts, [16, 0, 16])  # the one of budget 0 drafts nothing
    alone = [fork.propose(context, 16) for fork, context in zip(forks(), contexts)]
    assert together[1].tokens.numel() == 0
    for index in (0, 2):
        assert torch.equal(together[index].tokens, alone[index].tokens)
        assert torch.equal(together[index].parents, alone[index].parents)
        assert torch.equal(together[index].scores, alone[index].scores)
        assert together[index].tokens.numel() > 4  # a real tree
    assert not torch.equal(together[0].tokens[:4], together[2].tokens[:4])  # each from its own context


def test_no_shipped_head_for_a_target_names_the_training_command():
    with pytest.raises(ConfigError, match="draftwise train --kind eagle --target gemma3-270m"):
        head_for("gemma3-270m", "eagle")
    with pytest.raises(ConfigError, match="no medusa head is shipped for qwen2.5-coder-1.5b"):
        head_for("qwen2.5-coder-1.5b", "medusa")


def test_a_model_of_a_shipped_heads_shape_is_told_which_head_fits(smollm2):
    """A packaged model's file in another quantization (or a copy under another name) has no head
    shipped under its own name: the error names the shipped head of its shape, and only that one."""
    with pytest.raises(ConfigError) as refused:
        head_for("/models/SmolLM2-135M-Instruct-Q8_0.gguf", "eagle", smollm2.model.shape)
    message = str(refused.value)
    assert "The shipped eagle head for smollm2-135m fits" in message
    assert f"pass --head {SHIPPED / 'smollm2-135m' / 'eagle'}." in message
    assert "head for qwen2.5-coder-1.5b fits" not in message
    with pytest.raises(ConfigError) as refused:
        head_for("my-model.gguf", "eagle", replace(smollm2.model.shape, hidden_size=512))
    assert "--head" in str(refused.value) and "fits this model's shape" not in str(refused.value)


@pytest.mark.parametrize("drafter, head, message", [
    ("egale", None, "unknown drafter 'egale': choose one of"),
    ("eagle", None, "no eagle head is shipped for qwen2.5-coder-0.5b"),
    ("medusa", None, "no medusa head is shipped for qwen2.5-coder-0.5b"),
    ("eagle", "missing", "is not a draft head"),
    ("eagle", "medusa", "is a head for --drafter medusa, not --drafter eagle"),
    ("medusa", "eagle", "is a head for --drafter eagle, not --drafter medusa"),
])
def test_a_wrong_or_missing_head_is_refused_before_the_target_loads(monkeypatch, tmp_path, drafter, head, message):
    """The target's load takes seconds (minutes for a first fetch): what the head drafters would
    refuse after it, draftwise.load refuses before it."""
    import draftwise
    from draftwise.heads import SHIPPED
    from draftwise.models import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the target loaded before the head was checked")

    monkeypatch.setattr(loading, "load", no_loading)
    folder = {None: None, "missing": str(tmp_path / "nothing-here"),
              "medusa": str(SHIPPED / "smollm2-135m" / "medusa"), "eagle": str(SHIPPED / "smollm2-135m" / "eagle")}[head]
    model = "qwen2.5-coder-0.5b" if head is None else "smollm2-135m"
    with pytest.raises(ConfigError, match=message):
        draftwise.load(model, drafter=drafter, head=folder, progress=False)
    # A good head is not refused: the load goes on (to the stub here).
    if head is not None:
        with pytest.raises(AssertionError, match="target loaded"):
            draftwise.load(model, drafter=drafter, head=str(SHIPPED / model / drafter), progress=False)


def test_a_head_stored_in_q8_0_blocks_drafts_exactly_as_its_bfloat16_file(smollm2, plain_outputs, tmp_path):
    """Q8_0 is what the drafter multiplies by anyway (compact_copy): a file in Q8_0 blocks is half
    the bytes of the bfloat16 one and gives the same blocks at run time, so the same drafts."""
    head = load_head(head_for("smollm2-135m", "eagle"), smollm2.model)
    assert head.config.weight_storage == "q8_0"  # the shipped file's
    with torch.no_grad():  # weights a bfloat16 file holds exactly
        for parameter in head.parameters():
            parameter.copy_(parameter.bfloat16().float())
    folders = {}
    for storage in ("bf16", "q8_0"):
        head.config = replace(head.config, weight_storage=storage)
        folders[storage] = head.save(tmp_path / storage)
    assert (folders["q8_0"] / "head.safetensors").stat().st_size < 0.6 * (folders["bf16"] / "head.safetensors").stat().st_size
    bf16, q8 = (load_head(folders[storage], smollm2.model) for storage in ("bf16", "q8_0"))
    assert (bf16.config.weight_storage, q8.config.weight_storage) == ("bf16", "q8_0")
    blocks_bf16 = dict(compact_copy(bf16).named_buffers())
    blocks_q8 = dict(compact_copy(q8).named_buffers())
    assert blocks_bf16.keys() == blocks_q8.keys()
    assert all(torch.equal(blocks_bf16[name], blocks_q8[name]) for name in blocks_bf16)
    engines = [Engine(smollm2, EagleDrafter(head, smollm2.model), 16) for head in (bf16, q8)]
    results = [[engine.generate(prompt, PARAMS) for prompt in PROMPTS[:4]] for engine in engines]
    assert [r.token_ids for r in results[1]] == plain_outputs[:4]
    assert [r.metrics.num_target_forwards for r in results[1]] == [r.metrics.num_target_forwards for r in results[0]]


def test_a_head_file_of_an_unknown_storage_is_refused(smollm2, tmp_path):
    shipped = head_for("smollm2-135m", "eagle")
    shutil.copytree(shipped, tmp_path / "head")
    fields = json.loads((tmp_path / "head" / "head.json").read_text())
    (tmp_path / "head" / "head.json").write_text(json.dumps({**fields, "weight_storage": "q3_k"}))
    with pytest.raises(ConfigError, match="weight_storage='q3_k' is not a head storage"):
        load_head(tmp_path / "head", smollm2.model)


def test_the_qwen_head_ships_in_q8_0_blocks_shaped_for_its_target():
    """The Qwen2.5-Coder-1.5B head (trained on a lent H100; README): its file matches its config and
    the target's shape, its weights are finite, and its record shows the held-out acceptance."""
    fields, tensors = read_head_files(head_for("qwen2.5-coder-1.5b", "eagle"), "eagle", FORMAT_VERSION)
    config = EagleConfig(**fields)
    assert (config.target, config.hidden_size, config.target_vocab_size) == ("qwen2.5-coder-1.5b", 1536, 151936)
    assert config.weight_storage == "q8_0" and config.intermediate_size == 4096
    expected = {name: tuple(t.shape) for name, t in EagleHead(config).state_dict().items() if name != "lm_head.weight"}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    assert config.training["curve"][-1]["mean_accepted_length"] >= 2.5


def test_head_option_is_refused_for_drafters_without_heads():
    with pytest.raises(ConfigError, match="only read by drafter='eagle' or 'medusa'"):
        SpecConfig(drafter="ngram", head="somewhere")


class RecordingEagle(EagleDrafter):
    """An EagleDrafter that keeps every draft it proposes, and the nodes it was allowed."""

    drafts: list
    budgets: list[int]

    def propose(self, context: torch.Tensor, num_draft_tokens: int):
        draft = super().propose(context, num_draft_tokens)
        self.drafts.append(draft)
        self.budgets.append(num_draft_tokens)
        return draft


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9])
def test_trees_grow_only_from_nodes_sure_enough(smollm2, plain_outputs, eagle_head, threshold):
    """min_path_probability: a node has children only where its path probability reaches the
    threshold; 0 grows every level to the full depth. Greedy output equals plain decoding's
    whatever the tree, and a higher threshold drafts shallower trees."""
    drafter = RecordingEagle(eagle_head, smollm2.model, top_k=2, depth=5, min_path_probability=threshold, lookup=0)
    drafter.drafts, drafter.budgets = [], []
    tokens_per_forward = tokens_per_forward_if_equal(Engine(smollm2, drafter, num_draft_tokens=24), plain_outputs)
    for draft in drafter.drafts:
        scores, parents = draft.scores.tolist(), draft.parents.tolist()
        assert all(scores[p] >= threshold * (1 - 1e-6) for p in parents if p >= 0)
    # Steps allowed the whole candidate tree (2 + 4 x 4 = 18 nodes: a level grows top_k children
    # of each of its top_k best nodes; near an output's end fewer are allowed).
    depths = [int(tree.depths(draft.parents).max())
              for draft, budget in zip(drafter.drafts, drafter.budgets) if budget >= 18]
    assert len(depths) > 20
    # Measured (AMX Xeon): tokens per forward 2.16 / 2.05 / 1.88, mean depth 5 / 2.6 / 1.8.
    if threshold == 0.0:
        assert set(depths) == {5}
        assert tokens_per_forward > 2.0
    else:  # some trees stop after one level, some grow deeper
        assert min(depths) == 1 and max(depths) > 1 and tokens_per_forward > 1.5
    if threshold == 0.9:
        assert sum(depths) / len(depths) < 2.5


def test_a_frequency_ordered_head_drafts_from_a_prefix_of_its_vocabulary(smollm2, plain_outputs, eagle_head):
    """draft_vocab keeps the first rows of a head listed by frequency (the shipped SmolLM2 head):
    the kept tokens score exactly as in the whole head, only kept tokens are proposed, and greedy
    speculation stays equal to plain decoding."""
    assert eagle_head.config.vocab_by_frequency
    size = 1024
    whole = EagleDrafter(eagle_head, smollm2.model)
    kept = RecordingEagle(eagle_head, smollm2.model, draft_vocab=size, lookup=0)  # lookup copies any token
    assert torch.equal(kept.head.draft_to_target, eagle_head.draft_to_target[:size])
    outputs = torch.randn(3, eagle_head.config.hidden_size)
    assert whole._logits(outputs).shape[1] == eagle_head.config.draft_vocab_size
    torch.testing.assert_close(kept._logits(outputs), whole._logits(outputs)[:, :size], rtol=0, atol=1e-5)
    kept.drafts, kept.budgets = [], []
    assert tokens_per_forward_if_equal(Engine(smollm2, kept, num_draft_tokens=16), plain_outputs) > 1.5
    proposed = {token for draft in kept.drafts for token in draft.tokens.tolist()}
    assert proposed and proposed <= set(eagle_head.draft_to_target[:size].tolist())


def test_a_vocabulary_prefix_is_refused_where_a_head_lists_its_tokens_by_id(smollm2, eagle_head):
    by_id = EagleHead(replace(eagle_head.config, vocab_by_frequency=False))
    by_id.load_state_dict(eagle_head.state_dict())
    with pytest.raises(ConfigError, match="by id, not by frequency"):
        EagleDrafter(by_id, smollm2.model, draft_vocab=1024)
    assert EagleDrafter(by_id, smollm2.model).head.draft_to_target.shape[0] == eagle_head.config.draft_vocab_size
    with pytest.raises(ConfigError, match="below top_k"):
        EagleDrafter(eagle_head, smollm2.model, top_k=3, draft_vocab=2)


def test_a_negative_lookup_length_is_refused(smollm2, eagle_head):
    with pytest.raises(ConfigError, match="lookup=-1"):
        EagleDrafter(eagle_head, smollm2.model, lookup=-1)


@pytest.mark.parametrize("threshold", [-0.1, 1.0, 2.0])
def test_a_path_probability_threshold_outside_0_1_is_refused(smollm2, eagle_head, threshold):
    with pytest.raises(ConfigError, match=r"min_path_probability=.* must be in \[0, 1\)"):
        EagleDrafter(eagle_head, smollm2.model, min_path_probability=threshold)


def test_prompt_lookup_joins_the_tree_as_a_path_from_the_root(smollm2, eagle_head):
    """EagleDrafter(lookup=L): what followed the latest earlier occurrence of the context's last
    tokens joins the head's tree, along the head's own nodes where they spell it (their scores
    raised to the copy's where lower) and as new nodes below, each LOOKUP_LOG_PROBABILITY below
    its parent, so scores never rise from parent to child."""
    from draftwise.drafters.lookup import LOOKUP_LOG_PROBABILITY

    drafter = EagleDrafter(eagle_head, smollm2.model, lookup=8)
    context = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 5, 6])  # [5, 6] occurred before: [7, 8, ..., 6] followed
    step = LOOKUP_LOG_PROBABILITY
    for head_score, kept in ((math.log(0.9), math.log(0.9)), (math.log(0.1), step)):
        tokens, parents, scores, depths = [7, 99], [-1, -1], [head_score, math.log(0.05)], [1, 1]
        drafter.lookup.merge(context, tokens, parents, scores, depths)
        assert tokens == [7, 99, 8, 9, 10, 11, 12, 5, 6]
        assert parents == [-1, -1, 0, 2, 3, 4, 5, 6, 7] and depths == [1, 1, 2, 3, 4, 5, 6, 7, 8]
        assert scores[0] == pytest.approx(kept)
        assert scores[2:] == pytest.approx([kept + k * step for k in range(1, 8)])
    tokens, parents, scores, depths = [7], [-1], [0.0], [1]
    drafter.lookup.merge(torch.tensor([1, 2, 3, 4]), tokens, parents, scores, depths)  # no repeat: nothing added
    assert tokens == [7] and parents == [-1]


# Measured: 1.53 without prompt lookup, 1.79 with it (24-node drafts); ~10% below.
@pytest.mark.parametrize("lookup, floor", [(0, 1.35), (8, 1.6)])
def test_medusa_with_and_without_prompt_lookup_equals_plain_greedy(smollm2, plain_outputs, medusa_heads, lookup, floor):
    drafter = MedusaDrafter(medusa_heads, smollm2.model, lookup=lookup)
    assert tokens_per_forward_if_equal(Engine(smollm2, drafter, num_draft_tokens=24), plain_outputs) > floor


def test_medusa_refuses_a_negative_lookup_length(smollm2, medusa_heads):
    with pytest.raises(ConfigError, match="lookup=-1"):
        MedusaDrafter(medusa_heads, smollm2.model, lookup=-1)


@pytest.mark.parametrize("lookup", [0, 8])
def test_eagle_with_and_without_prompt_lookup_equals_plain_greedy(smollm2, plain_outputs, eagle_head, lookup):
    drafter = EagleDrafter(eagle_head, smollm2.model, lookup=lookup)
    assert tokens_per_forward_if_equal(Engine(smollm2, drafter, num_draft_tokens=24), plain_outputs) > 1.5


@pytest.mark.parametrize("vnni, expected", [(True, "int8"), (False, "float32")])
def test_the_head_multiplies_on_int8_activations_only_where_the_kernels_have_vnni(monkeypatch, eagle_head, vnni,
                                                                                   expected):
    """Without VNNI (AVX2 alone) int8 Q8_0 products are slower than float32 ones (docs/weight-formats.md, "CPUs
    with AVX2 but no AVX-512"), so the head's copy keeps float32 activations there."""
    from draftwise.models import kernels as kernels_module
    from draftwise.models.linear import BlockLinear

    monkeypatch.setattr(kernels_module, "has_vnni", lambda: vnni)
    compact = compact_copy(eagle_head)
    linears = [module for module in compact.modules() if isinstance(module, BlockLinear)]
    assert linears and {linear.weight.activations for linear in linears} == {expected}


@pytest.mark.parametrize("flags, built_with_vnni, expected", [
    ("flags\t: fpu avx2 fma avx512f avx512_vnni", True, True),
    ("flags\t: fpu avx2 fma avx512f avx512_vnni", False, False),  # DRAFTWISE_MARCH=x86-64-v3 on that CPU
    ("flags\t: fpu avx2 fma avx_vnni", False, False),
    ("flags\t: fpu avx2 fma f16c", False, False),
])
def test_vnni_is_what_the_loaded_build_has_and_else_what_the_cpu_has(monkeypatch, flags, built_with_vnni, expected):
    """A build for an instruction set below the CPU's (DRAFTWISE_MARCH) has AVX2's byte products
    even where the CPU has VNNI: the head then takes float32 activations there, as on a Zen 3."""
    from types import SimpleNamespace

    from draftwise.models import kernels as kernels_module

    monkeypatch.setattr(kernels_module, "_cpu_flags_line", lambda: flags)
    monkeypatch.setattr(kernels_module, "loaded_kernels", lambda: None)
    assert kernels_module.has_vnni() is ("avx512_vnni" in flags)
    build = SimpleNamespace(int8_dot_in_hardware=lambda: built_with_vnni)
    monkeypatch.setattr(kernels_module, "loaded_kernels", lambda: build)
    assert kernels_module.has_vnni() is expected


def test_the_native_build_has_vnni_exactly_where_the_cpu_does():
    """The compiled answer (the build's instruction-set macros) agrees with /proc/cpuinfo when the
    build is for this CPU."""
    from draftwise.models import kernels as kernels_module

    kernels = kernels_module.native_kernels(progress=False)
    if os.environ.get(kernels_module.MARCH_ENV):  # a build for another instruction set: VNNI only in AVX-512 code
        assert not kernels.int8_dot_in_hardware() or kernels.vector_paths() == "avx512"
    else:
        flags = kernels_module._cpu_flags_line().split()
        assert kernels.int8_dot_in_hardware() == ("avx512_vnni" in flags and "avx512f" in flags)
