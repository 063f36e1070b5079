"""The EAGLE drafter: a head on the target's hidden states (draftwise.heads.eagle) grows a tree.

Each step the head first reads the rows the target just committed (their fused hidden states
and the next tokens), then expands a dynamic tree as EAGLE-2 does (Li et al., "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", EMNLP 2024): the top_k best children of
each frontier node, the top_k best new nodes by path probability as the next frontier, up to
depth times; finally the best nodes overall by path probability, as many as the engine allows.
Only nodes whose path probability reaches min_path_probability are expanded, so a tree grows deep
where the head is sure (a formula, a repeated phrase) and stops after one level where it is not,
without paying a head forward for levels the target would reject. What prompt lookup copies
(NgramDrafter's match of the context's last tokens) joins the tree as one more path from its
root (`lookup`), free to draft: the head guesses what is new, the lookup what repeats. The nodes'
path probabilities go out as the draft's scores, so the draft-length policy can keep as many
nodes as this machine's measured forward costs pay for. The tokens are fixed guesses (point
masses), so sampling verifies them losslessly too (verify.verify_tree_rejection).
"""

from __future__ import annotations

import math

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, best_tree_draft, empty_draft
from draftwise.drafters.lookup import TreeLookup
from draftwise.errors import ConfigError
from draftwise.heads import check_target
from draftwise.heads.eagle import EagleHead, rotary_angles
from draftwise.models import ops
from draftwise.models.kernels import native_kernels

_CAUSAL = torch.empty(0, dtype=torch.bool)  # kernels.Decoder's "no mask": causal among the new rows


def compact_copy(head: torch.nn.Module) -> torch.nn.Module:
    """A copy of the head whose matrices are stored in Q8_0 blocks and multiplied by draftwise's
    kernels with int8 activations where they are built and the CPU has AVX-512 VNNI, float32 activations
    on AVX2 alone (there the SmolLM2 head drafted a 128-token story in 0.28-0.31 s on float32
    against 0.40-0.48 s on int8: 52.9 / 55.3 vs 44.6 / 51.5 tok/s, AMD EPYC Zen 3, 2 threads).
    A head drafts from a few rows at a time, so each of its forwards is bound by the bytes of its
    weights: in float32 the SmolLM2 head reads 43 MB per forward, 60% of its 4-bit target's whole
    weights; in Q8_0 it reads a quarter of that. Its numerics only decide which tokens are
    proposed, never what is emitted."""
    import copy

    from draftwise.models.kernels import has_vnni
    from draftwise.models.linear import WeightFormat, store_weights, use_activations

    if native_kernels(progress=False) is None:
        return head  # PyTorch's float32 ops: slower, same drafts up to rounding
    compact = store_weights(copy.deepcopy(head), WeightFormat.F32, quantize="int8")
    return use_activations(compact, "int8" if has_vnni() else "float32").eval()


def keep_vocabulary(head: torch.nn.Module, size: int) -> torch.nn.Module:
    """A copy of the head that scores only the first `size` tokens of its draft vocabulary (the
    most frequent ones where head.config.vocab_by_frequency): its LM head is a third of a
    drafting level's time; the tokens it drops can no longer be proposed (EagleDrafter's
    docstring has what that cost the shipped SmolLM2 head)."""
    import copy

    rows = head.lm_head.weight.shape[0]
    if size >= rows:
        return head
    if not head.config.vocab_by_frequency:
        raise ConfigError(f"draft_vocab={size}: this head lists its {rows} draft tokens by id, not by frequency, so "
                          "no prefix of them is the most frequent; keep all of them (draft_vocab=None) or retrain "
                          "the head with `draftwise train`.")
    kept = copy.deepcopy(head)
    kept.lm_head = torch.nn.Linear(kept.lm_head.in_features, size, bias=False)
    kept.lm_head.weight.data = head.lm_head.weight.data[:size].clone()
    kept.draft_to_target = head.draft_to_target[:size].clone()
    return kept


# Head forwards (and LM-head products) of more rows than this run on AMX tiles where the CPU has
# them: the prompt's rows, read once a request (SmolLM2's head read a 160-token chat prompt in 15
# ms and a 370-token RAG prompt in 35 ms through int8 activations, 2-4% of a 128-token answer),
# and a tree level's frontier of 3-4 nodes, where tiles beat int8's dot products (the 8192 x 576
# Q8_0 LM head, us for 1 / 3 / 8 rows: int8 184 / 308 / 565, amx 284 / 292 / 311). Above 2
# against above 16, `eagle` on SmolLM2 over the bench suite's chat / math / translation prompts
# (6 each, 128 tokens, both in one process, prompts alternated; AMX Xeon model 167, two runs):
# 1.619 -> 1.653x / 1.855 -> 1.841x / 1.907 -> 1.922x and 1.665 -> 1.683x / 1.833 -> 1.864x /
# 1.936 -> 1.951x plain. A drafter's numerics only choose what is proposed, so its rows need not
# be computed alike at every row count.
WIDE_ROWS = 2


def wide_activations() -> str | None:
    """"amx" where the kernels are built and the CPU has AMX tiles, else None (one path)."""
    kernels = native_kernels(progress=False)
    return "amx" if kernels is not None and kernels.amx_in_hardware() else None


def compiled_layer(head: torch.nn.Module, activations: str | None = None):
    """The compact head's decoder layer as a kernels.Decoder (one call for its attention and MLP,
    the same kernels as the target's layers, no input norm: the head's input projection feeds
    q, k and v directly), or None where the kernels are not built. The Python glue of a head row
    (about thirty PyTorch calls) cost SmolLM2 more time than the row's arithmetic. activations:
    what its linears round x to (None: each weight's own setting); the weights are shared."""
    from draftwise.models.linear import ACTIVATION_CODES, BlockLinear

    kernels, c = native_kernels(progress=False), head.config
    linears = [head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj, head.down_proj]
    if kernels is None or c.head_dim % 16 or not all(isinstance(linear, BlockLinear) for linear in linears):
        return None
    layer = kernels.Decoder(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
    layer.add_layer(torch.empty(0), head.mlp_norm.weight.detach().contiguous(),
                    [linear.weight.data for linear in linears], [int(linear.weight.format) for linear in linears],
                    [linear.weight.num_columns for linear in linears],
                    [ACTIVATION_CODES[activations or linear.weight.activations] for linear in linears],
                    [torch.empty(0)] * 7)
    return layer


class EagleDrafter:
    sequential = False  # one tree per step whatever its size; the policy trims nodes by score

    # Defaults measured on SmolLM2 with its shipped head (`python benchmarks/heads_side_by_side.py
    # HEAD --shapes 3x3,3x8:0.5,3x8:0.6,4x8:0.5 --per-category 6`: the bench suite's chat, math
    # and translation prompts, 6 a category, 96 tokens, each prompt through plain decoding and
    # every shape in turn, one process, AMX Xeon, 2 threads, 2026-11-26): fixed 3 x 3 trees 1.44x
    # plain (2.36 tokens a forward, drafting 3.4 ms a step); growing only nodes of path
    # probability >= 0.5, 3 x 8 1.55x (2.42, 2.9 ms), 4 x 8 1.58x (2.46, 2.7 ms); >= 0.6, 3 x 8
    # 1.56x. Without the threshold each level costs ~1 ms of drafting against a 9.6 ms token, and
    # deeper fixed trees did not pay (3 x 4 1.39x, 3 x 5 1.26x): most levels were grown where
    # nothing survived verification. Prompt lookup merged into the tree (lookup=8; `--lookup 0,8
    # --categories chat,math,translation,code_edit,rag_qa,summarization --per-category 2`): chat
    # 1.75x -> 1.93x, math 1.88x -> 1.99x, translation 1.43x -> 1.71x, code edits 1.14x -> 1.91x,
    # RAG 1.51x -> 1.85x, summaries 1.08x -> 1.20x, 1.40x -> 1.72x over the six; 4 / 8 / 16 copied
    # tokens 1.76x / 1.84x / 1.85x on chat, translation, code edits and RAG.
    def __init__(self, head: EagleHead, target_model, top_k: int = 4, depth: int = 8,
                 draft_vocab: int | None = None, min_path_probability: float = 0.5, lookup: int = 8) -> None:
        """top_k: children per expanded node, and nodes expanded per level; depth: the most levels;
        min_path_probability: the least path probability (the head's, the product along the path)
        of a node that is expanded, 0 to expand the top_k of every level; lookup: up to this many
        tokens copied from what followed the latest earlier occurrence of the context's last 2-4
        tokens (prompt lookup, NgramDrafter) join the tree as a path from its root, 0 for none;
        draft_vocab: how many of the head's draft tokens to score, most frequent first (None: all).
        Measured with the shipped SmolLM2 head (3 x 3 trees, AMX Xeon, 2026-11-26): 4,096 of its
        8,192 saved ~0.5 ms of a 3.2 ms drafting step but committed 4% fewer tokens a forward on
        24 new chat questions (2.61 -> 2.50), so all of them is the default."""
        check_target(head.config, target_model)
        if top_k < 1 or depth < 1:
            raise ConfigError(f"top_k ({top_k}) and depth ({depth}) must be at least 1")
        if not 0.0 <= min_path_probability < 1.0:
            raise ConfigError(f"min_path_probability={min_path_probability} must be in [0, 1): the least path "
                              "probability of a node the tree grows from (0: every level's top_k).")
        if draft_vocab is not None and draft_vocab < top_k:
            raise ConfigError(f"draft_vocab={draft_vocab} is below top_k={top_k}: a node needs top_k tokens to choose from.")
        self.head = compact_copy(head if draft_vocab is None else keep_vocabulary(head, draft_vocab))
        self.layer = compiled_layer(self.head)  # None: the head's PyTorch modules run it
        self.wide = wide_activations() if self.layer is not None else None  # for more than WIDE_ROWS rows
        self.wide_layer = compiled_layer(self.head, self.wide) if self.wide else None
        self.unit = torch.ones(head.config.hidden_size)  # fuse_features' weightless RMS scaling
        self.embed = target_model.model.embed_tokens  # the target's own embedding: [T] -> [T, hidden]
        self.hidden_layers = head.config.hidden_layers
        self.to_target = self.head.draft_to_target.tolist()  # draft-vocabulary id -> target id
        self.top_k = top_k
        self.depth = depth
        self.min_log_path = math.log(min_path_probability) if min_path_probability > 0 else float("-inf")
        self.lookup = TreeLookup.optional(lookup)

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        c = self.head.config
        capacity = max_length + self.depth * self.top_k + 1
        # [layers, batch, kv_heads, capacity, head_dim], as kernels.Decoder takes a cache
        self.keys = torch.zeros(1, 1, c.num_kv_heads, capacity, c.head_dim)
        self.values = torch.zeros(1, 1, c.num_kv_heads, capacity, c.head_dim)
        if self.layer is not None:  # the rotary angles of every position this request reaches, once
            cos, sin = rotary_angles(torch.arange(capacity), c.head_dim, c.rope_theta)
            self.cos, self.sin = cos.view(capacity, -1), sin.view(capacity, -1)
        self.num_rows = 0  # head rows over committed context (target features), kept in the cache
        self.pending: list[torch.Tensor] = []  # target hidden states not read yet
        self.last_output: torch.Tensor | None = None  # the last committed row's output [hidden]

    def observe(self, hidden: torch.Tensor) -> None:
        self.pending.append(hidden)

    def rollback(self, num_valid: int) -> None:
        pass  # the cache keeps committed rows only; draft rows are overwritten by the next step

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        if self.pending:
            self._read_committed(context)
        if num_draft_tokens == 0 or self.last_output is None:
            return empty_draft()
        return self._grow_tree(context, num_draft_tokens)

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, start: int,
             mask: torch.Tensor) -> torch.Tensor:
        """Head rows written at cache slots start..start + R - 1 -> their outputs [R, hidden]. mask
        [R, W] over the last W of slots 0..start + R - 1 (every slot before those is seen), or
        empty: causal among the new rows."""
        head = self.head
        rows, end = tokens.shape[0], start + tokens.shape[0]
        if self.layer is not None:
            x = self._linear(head.input_proj, torch.cat((self._norm(self.embed(tokens), head.embed_norm),
                                                         self._norm(features, head.feature_norm)), dim=-1))  # head.inputs
            layer = self.wide_layer if self.wide_layer is not None and rows > WIDE_ROWS else self.layer
            return layer.forward(x, self.cos[positions], self.sin[positions], [self.keys], [self.values],
                                 [start], [0], [rows], [mask], [])[0]
        x, q, k, v = head.project(features, self.embed(tokens), positions)
        keys, values = self.keys[0, 0], self.values[0, 0]  # [kv_heads, capacity, head_dim]
        keys[:, start:end], values[:, start:end] = k.transpose(0, 1), v.transpose(0, 1)
        if not mask.numel():
            mask = torch.ones(rows, rows, dtype=torch.bool).tril()
        seen = torch.cat((torch.ones(rows, end - mask.shape[1], dtype=torch.bool), mask), dim=1)
        return head.finish(x, q, keys[:, :end].transpose(0, 1), values[:, :end].transpose(0, 1), seen)

    # The head's norms through ops.rms_norm (one kernel call where the kernels are built, not the
    # five PyTorch ops of heads.eagle.RMSNorm, which must stay differentiable for training; the
    # same formula without them).
    @staticmethod
    def _norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return ops.rms_norm(x, norm.weight, norm.eps)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """head.fuse_features: the target's hidden states [R, layers * hidden] -> [R, hidden]."""
        layered = hidden.float().reshape(-1, self.unit.shape[0])  # each layer's state its own row
        scaled = ops.rms_norm(layered, self.unit, self.head.config.rms_norm_eps)
        return self._linear(self.head.fuse, scaled.view(hidden.shape[0], -1))

    def _linear(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """linear(x), with the wide activations for more than WIDE_ROWS rows where there are (the
        head's linears have no bias)."""
        if self.wide is None or x.shape[0] <= WIDE_ROWS:
            return linear(x)
        return linear.weight.matmul(x, self.wide)

    def _logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """head.logits: outputs [R, hidden] -> [R, draft vocab]."""
        return self._linear(self.head.lm_head, self._norm(outputs, self.head.norm))

    def _read_committed(self, context: torch.Tensor) -> None:
        """Row r reads the target's feature of position r and token r + 1, which are now committed."""
        features = self._features(torch.cat(self.pending))  # [R, hidden]
        self.pending = []
        first, rows = self.num_rows, features.shape[0]
        positions = torch.arange(first, first + rows)
        outputs = self._run(features, context[positions + 1], positions + 1, first, _CAUSAL)
        self.num_rows += rows
        self.last_output = outputs[-1]

    def _grow_tree(self, context: torch.Tensor, num_nodes: int) -> Draft:
        # The bookkeeping is Python lists and one tensor per level for each of the head's
        # inputs: each PyTorch call costs a few microseconds, and a level's call count once cost
        # as much as its arithmetic.
        top_k, num_committed, to_target = self.top_k, context.shape[0], self.to_target
        tokens: list[int] = []  # target ids
        parents: list[int] = []
        scores: list[float] = []  # log path probabilities
        depths: list[int] = []
        slot_of: dict[int, int] = {}  # expanded node -> its draft row, slot num_rows + that
        ancestors: dict[int, list[int]] = {-1: []}
        outputs = self.last_output[None]  # the frontier's outputs [F, hidden], the features its children read
        frontier = [-1]  # the last committed token: its children come from the last committed row
        for depth in range(1, self.depth + 1):
            best = torch.log_softmax(self._logits(outputs), dim=-1).topk(top_k, dim=-1)  # [F, top_k]
            children = []
            for row, (parent, values, indices) in enumerate(zip(frontier, best.values.tolist(), best.indices.tolist())):
                base = scores[parent] if parent >= 0 else 0.0
                for value, token in zip(values, indices):
                    node = len(tokens)
                    tokens.append(to_target[token])
                    parents.append(parent)
                    scores.append(base + value)
                    depths.append(depth)
                    ancestors[node] = ancestors[parent] + [node]
                    children.append((node, row))
            if depth == self.depth:
                break
            # Expand the top_k new nodes by path probability: one head forward over all of them,
            # written after the draft rows already in the cache, each seeing its ancestors' rows.
            children.sort(key=lambda child: -scores[child[0]])
            expanded = [(node, row) for node, row in children[:top_k] if scores[node] >= self.min_log_path]
            if not expanded:  # no node sure enough to grow: the tree stops at this level
                break
            frontier = [node for node, _ in expanded]
            placed = len(slot_of)  # draft rows in the cache, from slot num_rows on
            for index, node in enumerate(frontier):
                slot_of[node] = placed + index
            mask = [[False] * (placed + len(frontier)) for _ in frontier]
            for row, node in enumerate(frontier):
                for ancestor in ancestors[node]:
                    mask[row][slot_of[ancestor]] = True  # its ancestors' rows and its own
            features = outputs[[row for _, row in expanded]]  # each node reads its parent's output
            # Node at depth d holds the token of position num_committed - 1 + d.
            positions = torch.full((len(frontier),), num_committed - 1 + depth)
            draft_ids = torch.tensor([tokens[node] for node in frontier])
            outputs = self._run(features, draft_ids, positions, self.num_rows + placed, torch.tensor(mask))
        if self.lookup:
            self.lookup.merge(context, tokens, parents, scores, depths)
        # The best nodes overall; a node's ancestors score at least as well, so they come first.
        return best_tree_draft(tokens, parents, scores, depths, num_nodes, key="eagle")
