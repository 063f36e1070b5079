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
from itertools import accumulate

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

    @property
    def model(self) -> torch.nn.Module:
        """The weights this drafter's forks share (draftwise.step groups requests by it and drafts
        for them together: propose_together)."""
        return self.head

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        return EagleDrafter.propose_together([self], [context], [num_draft_tokens])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_together(drafters: list["EagleDrafter"], contexts: list[torch.Tensor],
                         budgets: list[int]) -> list[Draft]:
        """Trees for several requests whose drafters are forks of one (a batch of the server or
        of Engine.generate_batch): each head forward and each LM-head product of a level runs
        ONCE for all their rows (one segment per request's head cache), where one request at a
        time paid a forward per request per level. What is proposed never changes a request's
        output (the target verifies every token losslessly), so a tree may differ from the one
        the request would grow alone where the rows' count picks other activations (WIDE_ROWS);
        propose() is this with one request."""
        if drafters[0].layer is None and len(drafters) > 1:  # the head's PyTorch modules: one request at a time
            return [EagleDrafter.propose_together([drafter], [context], [budget])[0]
                    for drafter, context, budget in zip(drafters, contexts, budgets)]
        reading = [index for index, drafter in enumerate(drafters) if drafter.pending]
        if reading:
            EagleDrafter._read_committed([drafters[i] for i in reading], [contexts[i] for i in reading])
        drafts = [empty_draft() for _ in drafters]
        growing = [index for index, (drafter, budget) in enumerate(zip(drafters, budgets))
                   if budget and drafter.last_output is not None]
        if growing:
            trees = EagleDrafter._grow_trees([drafters[i] for i in growing], [contexts[i] for i in growing],
                                             [budgets[i] for i in growing])
            for index, draft in zip(growing, trees):
                drafts[index] = draft
        return drafts

    @staticmethod
    def _run(drafters: list["EagleDrafter"], features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             starts: list[int], num_rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
        """Head rows -> their outputs [R, hidden]: drafter i's num_rows[i] rows (in order, after
        drafter i - 1's) written at its cache slots starts[i].., each seeing the last W of its
        slots 0..start + rows - 1 as masks[i] [rows, W] says (every slot before those is seen),
        or, for an empty mask, causal among its new rows."""
        first = drafters[0]
        head = first.head
        rows = tokens.shape[0]
        if first.layer is not None:
            x = first._linear(head.input_proj, torch.cat((first._norm(first.embed(tokens), head.embed_norm),
                                                          first._norm(features, head.feature_norm)), dim=-1))  # head.inputs
            layer = first.wide_layer if first.wide_layer is not None and rows > WIDE_ROWS else first.layer
            first_rows = [end - n for end, n in zip(accumulate(num_rows), num_rows)]
            # each request's rows from its own table (a position's angles, whatever the table's length)
            mine = [positions[row:row + n] for row, n in zip(first_rows, num_rows)]
            cos = _joined([d.cos[p] for d, p in zip(drafters, mine)])
            sin = _joined([d.sin[p] for d, p in zip(drafters, mine)])
            return layer.forward(x, cos, sin, [d.keys for d in drafters], [d.values for d in drafters], starts,
                                 first_rows, num_rows, masks, [])[0]
        (mask,), (start,) = masks, starts  # the head's modules: one request (propose_together)
        end = start + rows
        x, q, k, v = head.project(features, first.embed(tokens), positions)
        keys, values = first.keys[0, 0], first.values[0, 0]  # [kv_heads, capacity, head_dim]
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

    @staticmethod
    def _read_committed(drafters: list["EagleDrafter"], contexts: list[torch.Tensor]) -> None:
        """Row r of a request reads the target's feature of position r and token r + 1, which are
        now committed: every request's new rows in one head forward."""
        pending = [_joined(drafter.pending) for drafter in drafters]
        features = drafters[0]._features(_joined(pending))  # [R, hidden], row-wise
        tokens, positions, num_rows = [], [], []
        for drafter, context, hidden in zip(drafters, contexts, pending):
            drafter.pending = []
            rows = hidden.shape[0]
            read = torch.arange(drafter.num_rows, drafter.num_rows + rows) + 1
            tokens.append(context[read])
            positions.append(read)
            num_rows.append(rows)
        outputs = EagleDrafter._run(drafters, features, _joined(tokens), _joined(positions),
                                    [drafter.num_rows for drafter in drafters], num_rows, [_CAUSAL] * len(drafters))
        end = 0
        for drafter, rows in zip(drafters, num_rows):
            end += rows
            drafter.num_rows += rows
            drafter.last_output = outputs[end - 1]

    @staticmethod
    def _grow_trees(drafters: list["EagleDrafter"], contexts: list[torch.Tensor], budgets: list[int]) -> list[Draft]:
        """Each request's tree, level by level: one LM-head product for every request's frontier,
        then one head forward for every request's expanded nodes."""
        trees = [_Tree(drafter, context) for drafter, context in zip(drafters, contexts)]
        growing = trees
        first = drafters[0]
        for depth in range(1, first.depth + 1):
            outputs = _joined([tree.outputs for tree in growing])
            best = torch.log_softmax(first._logits(outputs), dim=-1).topk(first.top_k, dim=-1)  # [F, top_k]
            values, indices, row = best.values.tolist(), best.indices.tolist(), 0
            expanding = []
            for tree in growing:
                rows = len(tree.frontier)
                if tree.add_children(depth, values[row:row + rows], indices[row:row + rows]) and depth < first.depth:
                    expanding.append(tree)
                row += rows
            if not expanding:
                break
            # One head forward over every expanded node of every request, written after the draft
            # rows already in its cache, each seeing its ancestors' rows.
            steps = [tree.expand(depth) for tree in expanding]
            outputs = EagleDrafter._run([tree.drafter for tree in expanding], _joined([step[0] for step in steps]),
                                        _joined([step[1] for step in steps]), _joined([step[2] for step in steps]),
                                        [step[3] for step in steps], [step[1].shape[0] for step in steps],
                                        [step[4] for step in steps])
            row = 0
            for tree in expanding:
                rows = len(tree.frontier)
                tree.outputs = outputs[row:row + rows]
                row += rows
            growing = expanding
        return [tree.draft(context, budget) for tree, context, budget in zip(trees, contexts, budgets)]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy for one tensor (one request's drafting, the common case)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class _Tree:
    """One request's tree while it grows (EagleDrafter._grow_trees). The bookkeeping is Python
    lists and one tensor per level for each of the head's inputs: each PyTorch call costs a few
    microseconds, and a level's call count once cost as much as its arithmetic."""

    def __init__(self, drafter: EagleDrafter, context: torch.Tensor) -> None:
        self.drafter = drafter
        self.num_committed = context.shape[0]
        self.tokens: list[int] = []  # target ids
        self.parents: list[int] = []
        self.scores: list[float] = []  # log path probabilities
        self.depths: list[int] = []
        self.slot_of: dict[int, int] = {}  # expanded node -> its draft row, slot num_rows + that
        self.ancestors: dict[int, list[int]] = {-1: []}
        self.outputs = drafter.last_output[None]  # the frontier's outputs [F, hidden], the features its children read
        self.frontier = [-1]  # the last committed token: its children come from the last committed row
        self.children: list[tuple[int, int]] = []  # this level's new nodes: (node, its parent's frontier row)

    def add_children(self, depth: int, values: list[list[float]], indices: list[list[int]]) -> bool:
        """The top_k children of each frontier node (their log-probabilities and draft-vocabulary
        ids, a row per frontier node); True if a child is sure enough to expand."""
        to_target = self.drafter.to_target
        self.children = []
        for row, (parent, row_values, row_indices) in enumerate(zip(self.frontier, values, indices)):
            base = self.scores[parent] if parent >= 0 else 0.0
            for value, token in zip(row_values, row_indices):
                node = len(self.tokens)
                self.tokens.append(to_target[token])
                self.parents.append(parent)
                self.scores.append(base + value)
                self.depths.append(depth)
                self.ancestors[node] = self.ancestors[parent] + [node]
                self.children.append((node, row))
        # Expand the top_k new nodes by path probability.
        self.children.sort(key=lambda child: -self.scores[child[0]])
        self.children = [(node, row) for node, row in self.children[:self.drafter.top_k]
                         if self.scores[node] >= self.drafter.min_log_path]
        return bool(self.children)

    def expand(self, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """The head's inputs for this level's expanded nodes: features (each node reads its
        parent's output), draft ids, positions, first cache slot, mask over the draft rows."""
        expanded, self.children = self.children, []
        self.frontier = [node for node, _ in expanded]
        placed = len(self.slot_of)  # draft rows in the cache, from slot num_rows on
        for index, node in enumerate(self.frontier):
            self.slot_of[node] = placed + index
        mask = [[False] * (placed + len(self.frontier)) for _ in self.frontier]
        for row, node in enumerate(self.frontier):
            for ancestor in self.ancestors[node]:
                mask[row][self.slot_of[ancestor]] = True  # its ancestors' rows and its own
        features = self.outputs[[row for _, row in expanded]]
        # Node at depth d holds the token of position num_committed - 1 + d.
        positions = torch.full((len(self.frontier),), self.num_committed - 1 + depth)
        draft_ids = torch.tensor([self.tokens[node] for node in self.frontier])
        return features, draft_ids, positions, self.drafter.num_rows + placed, torch.tensor(mask)

    def draft(self, context: torch.Tensor, num_nodes: int) -> Draft:
        lookup = self.drafter.lookup
        if lookup:
            lookup.merge(context, self.tokens, self.parents, self.scores, self.depths)
        # The best nodes overall; a node's ancestors score at least as well, so they come first.
        return best_tree_draft(self.tokens, self.parents, self.scores, self.depths, num_nodes, key="eagle")
