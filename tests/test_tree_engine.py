"""Trees through the engine on the real SmolLM2-135M: a node's logits in a tree forward equal its
path's logits computed as a chain, greedy tree speculation equals plain greedy decoding, and
after keeping any path of any tree the KV cache equals a replay of the committed tokens."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, empty_draft
from draftwise.engine import Engine
from draftwise.tree import ancestor_mask, depths
from tests.conftest import PROMPTS

PARAMS = SamplingParams(max_new_tokens=24)
VOCAB = 49152


def tree_forward(model, prompt: torch.Tensor, tokens: list[int], parents: list[int], cache_length: int = 64):
    """Prefill prompt[:-1], then score prompt[-1] and the tree in one forward -> (logits, cache)."""
    cache = model.new_cache(cache_length)
    model.forward(prompt[:-1], torch.arange(prompt.shape[0] - 1), cache)
    parents_tensor = torch.tensor(parents)
    positions = prompt.shape[0] - 1 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents_tensor)))
    inputs = torch.cat((prompt[-1:], torch.tensor(tokens)))
    return model.forward(inputs, positions, cache, ancestor_mask(parents_tensor)), cache


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_tree(rng: random.Random, num_nodes: int) -> list[int]:
    return [rng.randrange(-1, node) for node in range(num_nodes)]


def test_tree_node_logits_equal_their_paths_scored_as_a_chain(smollm2):
    # Batch invariance extends to trees: a node's row sees exactly its ancestors, at its depth.
    model = smollm2.model
    prompt = torch.tensor(smollm2.tokenizer.encode("The capital of France is"))
    rng = random.Random(0)
    parents = random_tree(rng, 10)
    tokens = [rng.randrange(VOCAB) for _ in parents]
    tree_logits, _ = tree_forward(model, prompt, tokens, parents)
    for node in range(len(parents)):
        chain = [tokens[i] for i in path_to(node, parents)]
        cache = model.new_cache(64)
        context = torch.cat((prompt, torch.tensor(chain)))
        chain_logits = model.forward(context, torch.arange(context.shape[0]), cache, num_logits=1)
        assert torch.equal(tree_logits[node + 1], chain_logits[0]), f"node {node} (path {path_to(node, parents)})"


class HiddenPathTreeDrafter:
    """A test drafter that knows plain greedy decoding's output and hides it in random trees:
    at each depth the right token sits among 1-3 wrong siblings at a random place (sometimes
    it is missing), and wrong nodes get random children too. Greedy verification must find the
    right path wherever it is, and the cache must keep that path however it was scattered."""

    sequential = False

    def __init__(self, sequences: list[list[int]], seed: int) -> None:
        self.sequences = sequences
        self.rng = random.Random(seed)
        self.num_scattered_accepts = 0  # accepted paths that were not the tree's first nodes
        self.last_right_nodes: list[int] = []
        self.last_context_length = 0

    def begin(self, params, generator, max_length) -> None:
        pass

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        ids = context.tolist()
        right = next((s[len(ids):] for s in self.sequences if s[: len(ids)] == ids), [])
        tokens: list[int] = []
        parents: list[int] = []
        right_nodes: list[int] = []
        frontier = [(-1, True)]  # (node, on the right path)
        depth = 0
        while frontier and len(tokens) < num_draft_tokens:
            next_frontier = []
            for parent, on_path in frontier:
                children = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))]
                if on_path and depth < len(right) and self.rng.random() < 0.85:
                    children.insert(self.rng.randrange(len(children) + 1), right[depth])
                for token in children:
                    if len(tokens) == num_draft_tokens:
                        break
                    good = on_path and depth < len(right) and token == right[depth]
                    tokens.append(token)
                    parents.append(parent)
                    if good:
                        right_nodes.append(len(tokens) - 1)
                    next_frontier.append((len(tokens) - 1, good))
            frontier = next_frontier
            depth += 1
        self.last_right_nodes = right_nodes
        self.last_context_length = len(ids)
        if not tokens:
            return empty_draft()
        return Draft(torch.tensor(tokens), None, parents=torch.tensor(parents))

    def rollback(self, num_valid: int) -> None:
        accepted = self.last_right_nodes[: num_valid - self.last_context_length]
        if accepted and accepted != list(range(len(accepted))):
            self.num_scattered_accepts += 1


def test_greedy_tree_speculation_equals_plain_greedy(smollm2):
    plain = Engine(smollm2)
    outputs = [plain.generate(prompt, PARAMS).token_ids for prompt in PROMPTS]
    sequences = [plain.encode(prompt) + output for prompt, output in zip(PROMPTS, outputs)]
    drafter = HiddenPathTreeDrafter(sequences, seed=1)
    engine = Engine(smollm2, drafter, num_draft_tokens=12)
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    for prompt, result, expected in zip(PROMPTS, results, outputs):
        assert result.token_ids == expected, f"prompt {prompt!r}"
    assert sum(r.metrics.num_accepted_tokens for r in results) > len(PROMPTS)  # trees were really accepted
    assert drafter.num_scattered_accepts > 0  # ... and paths were compacted, not just prefixes kept


def test_sampling_through_trees_with_top_k_one_reproduces_greedy(smollm2):
    # top_k=1 makes the target a point mass: the tree rejection sampler must then emit greedy's tokens.
    plain = Engine(smollm2)
    prompts = PROMPTS[:4]
    outputs = [plain.generate(prompt, PARAMS).token_ids for prompt in prompts]
    sequences = [plain.encode(prompt) + output for prompt, output in zip(prompts, outputs)]
    engine = Engine(smollm2, HiddenPathTreeDrafter(sequences, seed=2), num_draft_tokens=8)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=1, seed=5)
    for prompt, expected in zip(prompts, outputs):
        assert engine.generate(prompt, params).token_ids == expected


@pytest.fixture(scope="module")
def small_target(smollm2):
    return smollm2.model.truncated(3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), num_nodes=st.integers(1, 12), num_steps=st.integers(1, 4))
def test_cache_after_keeping_any_tree_path_equals_replay(small_target, seed, num_nodes, num_steps):
    rng = random.Random(seed)
    committed = [rng.randrange(VOCAB) for _ in range(5)]
    cache = small_target.new_cache(96)
    small_target.forward(torch.tensor(committed[:-1]), torch.arange(4), cache)
    for _ in range(num_steps):
        parents = random_tree(rng, num_nodes)
        tokens = [rng.randrange(VOCAB) for _ in parents]
        num_committed = len(committed)
        positions = num_committed - 1 + torch.cat((torch.zeros(1, dtype=torch.long), depths(torch.tensor(parents))))
        inputs = torch.tensor(committed[-1:] + tokens)
        small_target.forward(inputs, positions, cache, ancestor_mask(torch.tensor(parents)))
        path = path_to(rng.randrange(-1, num_nodes), parents)  # any path, the empty one included
        cache.keep_path(num_committed, path)
        committed += [tokens[node] for node in path] + [rng.randrange(VOCAB)]
        assert cache.length == len(committed) - 1
    replay = small_target.new_cache(96)
    small_target.forward(torch.tensor(committed[:-1]), torch.arange(len(committed) - 1), replay)
    length = cache.length
    # Batch-invariant kernels: the kept entries are bit-identical to the replay's.
    assert torch.equal(cache.keys[:, :, :, :length], replay.keys[:, :, :, :length])
    assert torch.equal(cache.values[:, :, :, :length], replay.values[:, :, :, :length])
