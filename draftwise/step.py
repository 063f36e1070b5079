"""ONE batched step: gather drafts -> flatten -> one target forward -> verify per sequence ->
commit/rollback. The only place caches are rolled back.

Every live sequence contributes its rows to one target forward: a decoding sequence its last
committed token plus its draft (empty, a chain or a tree), a prefilling one the next chunk of
its prompt. The linears read each weight once for all rows; attention runs per sequence over
its own cache; the native decoder computes every row with the same arithmetic whatever else the
forward holds, so a sequence's logits, and so its tokens, do not depend on the batch. Then each
sequence is verified on its own slice of the logits with its own random stream. The
single-request Engine is this step with a batch of one.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from draftwise import tree
from draftwise.config import SamplingParams
from draftwise.controller import BatchController
from draftwise.drafters.base import Draft, empty_draft
from draftwise.models.base import Segment, forward_segments
from draftwise.penalties import penalize
from draftwise.sampling import coupled_scores, logits_to_probs
from draftwise.sequence import Sequence
from draftwise.verify import Verdict, verify_greedy, verify_rejection, verify_tree_greedy, verify_tree_rejection


@dataclass(frozen=True, slots=True)
class Forced:
    """The key of a draft that opens with tokens the request's grammar forces (Constraint.forced)
    and goes on with the drafter's guess past them (key: that guess's own key; a drafter that
    reads the target's hidden states cannot guess past tokens the target has not read, and is
    not asked). Verified as any chain; only the guess counts in the drafter's statistics."""

    num_forced: int
    key: Hashable = None

# The most forced tokens a step drafts, beside the drafter's guess (the draft ceiling bounds that
# guess alone): they are accepted but where the target prefers another tokenization of the text.
MAX_FORCED_TOKENS = 16

# The most prompt tokens a step prefills for a request that scores its prompt (prompt_logprobs):
# each row's logits are kept, [rows, vocab] float32, 155 MB for 256 rows of Qwen2.5's 152k
# vocabulary. Chunks compute what one forward would (batch invariance): the same numbers.
SCORED_PREFILL_CHUNK = 256


@dataclass(slots=True)
class StepReport:
    """What one step did, for the server's metrics and the controller's observability."""

    batch_size: int = 0  # sequences in the forward
    num_rows: int = 0  # rows the forward scored
    num_prefill_rows: int = 0
    draft_tokens_chosen: list[int] = field(default_factory=list)  # per decoding sequence
    num_committed: int = 0
    forward_s: float = 0.0


def run_step(model, sequences: list[Sequence], controller: BatchController | None,
             hidden_layers: tuple[int, ...] = (), prefill_chunk: int | None = None,
             prefill_budget: int | None = None) -> StepReport:
    """Advance every unfinished sequence by one target forward. prefill_chunk: the most prompt
    tokens a prefilling sequence feeds per step (None: the whole prompt at once); prefill_budget:
    the most prompt tokens all of them feed together (None: no limit). Prefilling sequences take
    their chunks in order until the budget is spent; the rest wait for a later step."""
    live = [seq for seq in sequences if not seq.finished]
    chunks = {}
    budget = prefill_budget
    for seq in live:
        if seq.prefilling and (budget is None or budget > 0):
            chunk = prefill_chunk if budget is None else min(budget, prefill_chunk or budget)
            if seq.prompt_logprobs is not None:  # every row's logits are kept: bounded chunks bound their memory
                chunk = min(chunk or SCORED_PREFILL_CHUNK, SCORED_PREFILL_CHUNK)
            rows = _prefill_rows(seq, chunk)
            chunks[id(seq)] = rows
            if budget is not None:
                budget -= len(rows)
    live = [seq for seq in live if not seq.prefilling or id(seq) in chunks]
    report = StepReport(batch_size=len(live))
    if not live:
        return report
    decoding = [seq for seq in live if not seq.prefilling]
    forced = [_alone(seq, _forced_tokens, seq) for seq in decoding]  # [n] each, or None
    drafts = [draft if seq.finished else _alone(seq, _inside_grammar, seq, draft, after)
              for seq, draft, after in zip(decoding, _propose_all(decoding, forced), forced)]
    if any(seq.finished for seq in decoding):  # failed while drafting: out of the forward
        drafts = [draft for seq, draft in zip(decoding, drafts) if not seq.finished]
        forced = [after for seq, after in zip(decoding, forced) if not seq.finished]
        live = [seq for seq in live if not seq.finished]
        decoding = [seq for seq in decoding if not seq.finished]
        report.batch_size = len(live)
        if not live:
            return report
    report.num_prefill_rows = sum(len(rows) for rows in chunks.values())
    if controller is not None and decoding:
        completing = sum(seq.num_prefilled + len(chunks[id(seq)]) == len(seq.prompt_ids)
                         for seq in live if seq.prefilling)
        # Forced tokens are kept whole: their rows commit a token each, as the fixed rows do.
        num_forced = sum(after.shape[0] for after in forced if after is not None)
        choices = [(seq.policy, draft) for seq, draft in zip(decoding, drafts)]
        allocation = controller.allocate(choices, len(decoding) + report.num_prefill_rows + num_forced,
                                         len(decoding) + completing + num_forced, report.num_prefill_rows)
        drafts = [draft.trimmed(size) if size < draft.tokens.shape[0] else draft
                  for draft, size in zip(drafts, allocation.sizes)]
    drafts = [draft if after is None else _after_forced(after, draft) for draft, after in zip(drafts, forced)]
    report.draft_tokens_chosen = [draft.tokens.shape[0] for draft in drafts]

    segments, draft_of = [], {}  # draft_of: id(seq) -> (its draft, its segment)
    for seq in live:
        if seq.prefilling:
            rows = chunks[id(seq)]
            last = rows.stop == len(seq.prompt_ids)
            scores_prompt = seq.prompt_logprobs is not None  # then every row's logits, else the last's
            segments.append(Segment(torch.tensor(seq.prompt_ids[rows.start:rows.stop], dtype=torch.long),
                                    torch.arange(rows.start, rows.stop), seq.cache, None,
                                    len(rows) if scores_prompt else 1 if last else 0))
        else:
            draft = drafts[len(draft_of)]
            segment = _decode_segment(seq, draft)
            draft_of[id(seq)] = (draft, segment)
            segments.append(segment)
    report.num_rows = sum(segment.tokens.shape[0] for segment in segments)

    tic = time.perf_counter()
    outputs = forward_segments(model, segments, hidden_layers)
    report.forward_s = time.perf_counter() - tic
    if controller is not None:
        controller.observe_forward(report.num_rows, report.forward_s)

    for seq, output in zip(live, outputs):
        logits, hidden = output if hidden_layers else (output, None)
        before = seq.context.shape[0]
        if seq.prefilling:
            _alone(seq, _finish_chunk, seq, chunks[id(seq)], logits, hidden)
        else:
            _alone(seq, _verify_and_commit, seq, *draft_of[id(seq)], logits, hidden, report.forward_s)
        report.num_committed += seq.context.shape[0] - before
    return report


def _alone(seq: Sequence, work, *args):
    """One sequence's own part of the step (its drafter, its grammar, its verify and commit): an
    exception there fails that sequence alone (Sequence.fail: its caller gets the error) and the
    step goes on for its batch mates, whose state it never touches. The forward, shared by all,
    is not guarded: its failure is everyone's."""
    try:
        return work(*args)
    except Exception as error:  # anything: a user's drafter may raise what it likes
        seq.fail(error)
        return None


def _propose_all(decoding: list[Sequence], forced: list[torch.Tensor | None]) -> list[Draft]:
    """Every decoding sequence's draft for this step, at most its budget (a draft model asks its
    policy first: it pays a forward per token). Where the grammar forces tokens (forced[i]),
    the drafter guesses past them, in what budget they leave, if it drafts from tokens alone.
    Sequences whose drafters share one draft model (forks of one drafter with
    `propose_together`) draft together: each draft forward runs once for all of them, and each
    still gets the draft it would make alone (batch invariance)."""
    contexts = [seq.context if after is None else torch.cat((seq.context, after)) for seq, after in zip(decoding, forced)]
    budgets = [0 if seq.finished or after is not None and getattr(seq.drafter, "hidden_layers", ())
               else _alone(seq, _budget, seq, 0 if after is None else after.shape[0])
               for seq, after in zip(decoding, forced)]
    drafts: list[Draft | None] = [empty_draft() if seq.finished or not budget else None
                                  for seq, budget in zip(decoding, budgets)]
    groups: dict[tuple, list[int]] = {}
    for index, seq in enumerate(decoding):
        if drafts[index] is None and hasattr(seq.drafter, "propose_together"):
            groups.setdefault((type(seq.drafter), id(seq.drafter.model)), []).append(index)
    for members in groups.values():
        if len(members) == 1:  # alone: its own propose() below (what a subclass may override)
            continue
        tic = time.perf_counter()
        try:
            together = type(decoding[members[0]].drafter).propose_together(
                [decoding[i].drafter for i in members], [contexts[i] for i in members], [budgets[i] for i in members])
        except Exception as error:  # their forwards were shared: the group fails together
            for i in members:
                decoding[i].fail(error)
                drafts[i] = empty_draft()
            continue
        seconds = time.perf_counter() - tic  # the group's wall time: what each of its requests waited
        for i, draft in zip(members, together):
            drafts[i] = draft
            _observe_draft(decoding[i], budgets[i], seconds)
    for index, seq in enumerate(decoding):
        if drafts[index] is None:
            tic = time.perf_counter()
            drafts[index] = _alone(seq, seq.drafter.propose, contexts[index], budgets[index]) or empty_draft()
            _observe_draft(seq, budgets[index], time.perf_counter() - tic)
    return drafts


def _forced_tokens(seq: Sequence) -> torch.Tensor | None:
    """The tokens the request's grammar forces next (a JSON schema's keys, a tool call's tags and
    name), drafted as they are ahead of the drafter's guess: the target accepts them unless it
    prefers another tokenization of the same text, and the drafter, not knowing the grammar,
    would guess them worse. None: nothing forced, or a request that does not speculate (plain
    decoding, or a draft budget of 0)."""
    if seq.constraint is None or getattr(seq.drafter, "is_plain", False) or not seq.draft_budget():
        return None
    forced = seq.constraint.forced(min(MAX_FORCED_TOKENS, seq.room()))
    return torch.tensor(forced, dtype=torch.long) if forced else None


def _after_forced(forced: torch.Tensor, guess: Draft) -> Draft:
    """The forced tokens [n], then the drafter's guess past them (a chain; a tree guess is left out)."""
    num_forced = forced.shape[0]
    if guess.is_tree or not guess.tokens.shape[0]:
        return Draft(forced, None, Forced(num_forced))
    probs = None
    if guess.probs is not None:  # the forced tokens as point masses beside the guess's distributions
        probs = torch.cat((torch.nn.functional.one_hot(forced, guess.probs.shape[-1]).to(guess.probs.dtype), guess.probs))
    return Draft(torch.cat((forced, guess.tokens)), probs, Forced(num_forced, guess.key))


def _inside_grammar(seq: Sequence, draft: Draft, after: torch.Tensor | None = None) -> Draft:
    """A chain draft (which follows the forced tokens `after`, if any) cut before its first token
    the request's grammar refuses (it would be rejected at the verify: its row, and the rows after
    it, are saved). Trees are masked per row at the verify instead (draftwise.structured)."""
    if seq.constraint is None or draft.is_tree or not draft.tokens.shape[0]:
        return draft
    path = draft.tokens if after is None else torch.cat((after, draft.tokens))
    allowed = seq.constraint.allowed_prefix(path) - (path.shape[0] - draft.tokens.shape[0])
    return draft if allowed == draft.tokens.shape[0] else draft.trimmed(max(0, allowed))


def _is_sequential(seq: Sequence) -> bool:
    # getattr: a user drafter written without the attribute is treated as free to draft.
    return seq.policy is not None and getattr(seq.drafter, "sequential", False)


def _budget(seq: Sequence, num_forced: int = 0) -> int:
    """The most tokens the drafter may guess this step (after num_forced forced tokens)."""
    budget = max(0, min(seq.draft_budget(), seq.room() - num_forced))
    if budget > 0 and _is_sequential(seq):
        budget = seq.policy.choose_before_drafting(budget)
    return budget


def _observe_draft(seq: Sequence, budget: int, seconds: float) -> None:
    if _is_sequential(seq):
        seq.policy.observe_draft(budget, seconds)
    seq.metrics.draft_s += seconds


def _prefill_rows(seq: Sequence, prefill_chunk: int | None) -> range:
    end = len(seq.prompt_ids) if prefill_chunk is None else min(len(seq.prompt_ids), seq.num_prefilled + prefill_chunk)
    return range(seq.num_prefilled, end)


def _decode_segment(seq: Sequence, draft: Draft) -> Segment:
    """The cache holds every committed token but the last; score it and the draft at once."""
    num_committed = seq.context.shape[0]
    inputs = torch.cat((seq.context[-1:], draft.tokens))  # [1 + n]
    if draft.is_tree:  # each node sits one position past its parent and sees only its ancestors
        depths = tree.depths(draft.parents)
        positions = num_committed - 1 + torch.cat((torch.zeros(1, dtype=torch.long), depths))
        return Segment(inputs, positions, seq.cache, tree.ancestor_mask(draft.parents))  # mask [1 + n, 1 + n]
    return Segment(inputs, torch.arange(num_committed - 1, num_committed + draft.tokens.shape[0]), seq.cache)


def _finish_chunk(seq: Sequence, rows: range, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
    """A prompt chunk is in the cache; after the last one, the target picks the first token."""
    if hidden is not None:
        seq.observe(hidden)  # prompt rows: all of them are committed context
    if seq.prompt_logprobs is not None:
        seq.observe_prompt(rows, logits)
    seq.num_prefilled = rows.stop
    if seq.prefilling:
        return
    if seq.params.max_new_tokens == 0:  # scoring the prompt only
        seq.metrics.prefill_s = time.perf_counter() - seq.started
        seq.finish("length")
        return
    logits = logits[-1:]
    scores = _judged_rows(seq, logits, empty_draft().tokens, None)
    verdict = choose(empty_draft(), scores, seq.params, seq.generator, [len(seq.prompt_ids)])
    seq.metrics.prefill_s = time.perf_counter() - seq.started
    seq.metrics.record_step(0, 0, 1)
    seq.commit([verdict.next_token], logits)


def _verify_and_commit(seq: Sequence, draft: Draft, segment: Segment, logits: torch.Tensor,
                       hidden: torch.Tensor | None, forward_s: float) -> None:
    tic = time.perf_counter()
    num_committed = seq.context.shape[0]
    num_proposed = draft.tokens.shape[0]
    # Each row predicts the token one position past its own (the segment's positions hold the
    # tree depths already: computed once per step).
    predicted = (segment.positions + 1).tolist()
    verdict = choose(draft, _judged_rows(seq, logits, draft.tokens, segment.attn_mask), seq.params, seq.generator,
                     predicted)
    path = verdict.accepted_nodes()
    policy = seq.policy
    # The drafter's own record: its guess, where the verify reached it (past any forced tokens).
    num_forced = draft.key.num_forced if isinstance(draft.key, Forced) else 0
    key = draft.key.key if num_forced else draft.key
    num_guessed = num_proposed - num_forced if verdict.num_accepted >= num_forced else 0
    num_guessed_accepted = verdict.num_accepted - num_forced if num_guessed else 0
    if policy is not None and num_guessed:
        if draft.scores is not None:
            policy.observe_tree_verdict(key, float(draft.scores.sum()), num_guessed_accepted)
        else:
            policy.observe_verdict(key, num_guessed, num_guessed_accepted)
    # Roll back, in one place, both caches to the committed prefix they both saw; a tree's
    # accepted path moves next to the committed tokens.
    seq.cache.keep_path(num_committed, path)
    seq.drafter.rollback(num_committed + verdict.num_accepted)
    # The committed path's rows: the last committed token's (row 0) and the accepted nodes'. Row
    # i's logits chose the i-th new token; their hidden states became committed context.
    committed_rows = [0] + [node + 1 for node in path]
    if hidden is not None:
        seq.observe(hidden[committed_rows])
    metrics = seq.metrics
    metrics.target_forward_s += forward_s
    metrics.verify_s += forward_s + time.perf_counter() - tic
    depth = max(predicted) - num_committed - num_forced  # how far the guess reached: a chain's length, a tree's depth
    metrics.num_forced_tokens += min(num_forced, verdict.num_accepted)
    metrics.record_step(num_guessed, num_guessed_accepted, verdict.num_accepted + 1, depth if num_guessed else 0)
    seq.commit(draft.tokens[path].tolist() + [verdict.next_token],
               logits[committed_rows] if seq.logprobs is not None else None)


def _judged_rows(seq: Sequence, logits: torch.Tensor, draft_tokens: torch.Tensor,
                 tree_mask: torch.Tensor | None) -> torch.Tensor:
    """The rows the verifier judges by: the target's logits, with the request's logit_bias, each
    row penalised for the tokens on its own path where it sets penalties (draftwise.penalties)
    and masked to what its grammar allows there (draftwise.structured). In place unless the raw
    rows are still wanted (their logprobs, which are the model's own)."""
    scores = logits
    if seq.params.adjusts_logits:
        scores = penalize(logits, seq.params, seq.context, len(seq.prompt_ids), draft_tokens, tree_mask,
                          copy=seq.logprobs is not None, stop_ids=seq.eos)
    if seq.constraint is not None:
        if scores is logits and seq.logprobs is not None:
            scores = logits.clone()
        seq.constraint.mask(scores, draft_tokens, tree_mask)
    return scores


def choose(draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           positions: list[int]) -> Verdict:
    """Verify a (possibly empty) chain or tree draft against target logits [n + 1, vocab];
    positions: the output position each row predicts (coupled sampling keys its noise by it)."""
    if params.is_coupled:  # the target's own sample of every row; a draft token must equal it
        scores = coupled_scores(target_logits, params, positions)
        if draft.is_tree:
            return verify_tree_greedy(draft.tokens, draft.parents, scores)
        return verify_greedy(draft.tokens, scores)
    if draft.is_tree:
        if params.is_greedy:
            return verify_tree_greedy(draft.tokens, draft.parents, target_logits)
        target_probs = logits_to_probs(target_logits, params)
        return verify_tree_rejection(draft.tokens, draft.parents, draft.probs, target_probs, generator)
    if params.is_greedy:
        return verify_greedy(draft.tokens, target_logits)
    target_probs = logits_to_probs(target_logits, params)  # an empty draft just samples row 0
    return verify_rejection(draft.tokens, draft.probs, target_probs, generator)
