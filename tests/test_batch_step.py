"""The batched step: a sequence's output does not depend on what else is in the batch.

On the real SmolLM2-135M: logits of a batched forward are bit-identical to each sequence's
forward alone; sequences decoded together (different drafters, chains and trees, chunked
prefills, joining at different steps) produce exactly the tokens they produce alone, greedy
and seeded sampling; and the controller drafts long alone, less under load.
"""

from __future__ import annotations

import pytest
import torch

from draftwise import SamplingParams
from draftwise.controller import BatchController
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.base import Draft, fork_drafter
from draftwise.drafters.ngram import NgramDrafter
from draftwise.engine import Engine, NoDrafter, result_of
from draftwise.models.base import Segment
from draftwise.step import run_step
from draftwise import tree
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def eagle_drafter(smollm2):
    from draftwise.drafters.eagle import EagleDrafter
    from draftwise.heads import head_for
    from draftwise.heads.eagle import load_head

    return EagleDrafter(load_head(head_for("smollm2-135m", "eagle"), smollm2.model), smollm2.model)


def test_batched_forward_logits_are_bit_identical_to_each_sequence_alone(smollm2):
    model = smollm2.model
    torch.manual_seed(0)
    contexts = [torch.randint(0, 49152, (n,)) for n in (7, 30, 12)]
    parents = torch.tensor([-1, -1, 0, 0, 2])  # a tree of 5 nodes for the third sequence

    def segments_for(caches):
        out = []
        for index, (context, cache) in enumerate(zip(contexts, caches)):
            model.forward(context[:-4], torch.arange(context.shape[0] - 4), cache, num_logits=1)  # committed prefix
            if index == 2:
                depths = tree.depths(parents)
                tokens = torch.cat((context[-4:-3], torch.randint(0, 49152, (5,), generator=torch.Generator().manual_seed(1))))
                positions = context.shape[0] - 4 + torch.cat((torch.zeros(1, dtype=torch.long), depths))
                out.append(Segment(tokens, positions, cache, tree.ancestor_mask(parents)))
            else:
                out.append(Segment(context[-4:], torch.arange(context.shape[0] - 4, context.shape[0]), cache))
        return out

    alone = []
    for index in range(3):
        caches = [model.new_cache(64) for _ in contexts]
        segment = segments_for(caches)[index]
        alone.append(model.forward(segment.tokens, segment.positions, segment.cache, segment.attn_mask))
    caches = [model.new_cache(64) for _ in contexts]
    batched = model.forward_batch(segments_for(caches))
    for one, together in zip(alone, batched):
        assert torch.equal(one, together)
    # Each cache holds its own sequence's keys, as a forward alone would have written them.
    reference = [model.new_cache(64) for _ in contexts]
    segments = segments_for(reference)
    model.forward(segments[1].tokens, segments[1].positions, segments[1].cache)
    assert torch.equal(reference[1].keys[:, :, :, :30], caches[1].keys[:, :, :, :30])


def _decode_together(engine: Engine, jobs, join_steps, prefill_chunk=16, prefill_budget=None, reports=None):
    """Run jobs [(prompt, params, drafter, num_draft_tokens)] in one batch, each joining at its
    step; returns their results (and appends each step's report to `reports`). An engine without
    a draft-length policy verifies every draft token (fixed lengths)."""
    sequences = [None] * len(jobs)
    step = 0
    while step == 0 or any(seq is None or not seq.finished for seq in sequences):
        for index, (prompt, params, drafter, num_draft) in enumerate(jobs):
            if sequences[index] is None and join_steps[index] <= step:
                policy = engine.controller.new_policy() if engine.controller is not None else None
                sequences[index] = engine.start(engine.encode(prompt), params, fork_drafter(drafter), policy, num_draft)
        report = run_step(engine.target.model, [seq for seq in sequences if seq is not None], engine.controller,
                          engine.hidden_layers, prefill_chunk, prefill_budget)
        if reports is not None:
            reports.append(report)
        step += 1
    return [result_of(seq) for seq in sequences]


def _jobs(params_for, ngram, eagle=None):
    drafters = [NoDrafter(), ngram, ngram, ngram, NoDrafter(), ngram]
    jobs = [(PROMPTS[i], params_for(i), drafters[i], [None, 10, 3, 0, None, None][i]) for i in range(6)]
    return jobs


def test_greedy_batch_equals_each_request_alone(smollm2):
    """Mixed drafters (plain, n-gram with different ceilings, speculation off), prompts of
    different lengths prefilled in 16-token chunks beside others' decoding, joining at
    different steps: every output equals plain greedy decoding of that prompt alone."""
    ngram = NgramDrafter(1, 3)
    from draftwise.draft_length import DraftLengthPolicy

    engine = Engine(smollm2, ngram, 10, DraftLengthPolicy())
    plain = Engine(smollm2)
    jobs = _jobs(lambda i: SamplingParams(max_new_tokens=28), ngram)
    together = _decode_together(engine, jobs, join_steps=[0, 0, 3, 5, 9, 9])
    for (prompt, params, _, _), result in zip(jobs, together):
        assert result.token_ids == plain.generate(prompt, params).token_ids
    assert sum(r.metrics.num_accepted_tokens for r in together) > 0  # speculation really ran


def test_a_step_prefill_budget_makes_prompts_wait_their_turn_and_changes_no_output(smollm2):
    """With at most 20 prompt tokens per step for all prefilling sequences together (16 each),
    six prompts arriving at once enter a few at a time; no step exceeds the budget, some step
    leaves a prompt waiting, and every output still equals plain greedy decoding alone."""
    ngram = NgramDrafter(1, 3)
    from draftwise.draft_length import DraftLengthPolicy

    engine = Engine(smollm2, ngram, 10, DraftLengthPolicy())
    plain = Engine(smollm2)
    jobs = _jobs(lambda i: SamplingParams(max_new_tokens=12), ngram)
    reports = []
    together = _decode_together(engine, jobs, join_steps=[0] * 6, prefill_budget=20, reports=reports)
    assert max(report.num_prefill_rows for report in reports) <= 20
    assert any(report.batch_size < 6 and report.num_prefill_rows for report in reports[:3])  # some prompt waited
    for (prompt, params, _, _), result in zip(jobs, together):
        assert result.token_ids == plain.generate(prompt, params).token_ids


@pytest.fixture(scope="module")
def medusa_drafter(smollm2):
    from draftwise.drafters.medusa import MedusaDrafter
    from draftwise.heads import head_for
    from draftwise.heads.medusa import load_medusa

    return MedusaDrafter(load_medusa(head_for("smollm2-135m", "medusa"), smollm2.model), smollm2.model)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_head_trees_in_a_batch_equal_plain_greedy(smollm2, eagle_drafter, medusa_drafter, kind):
    """Forks of one head draft together (propose_together), requests joining at different steps:
    every output equals plain greedy decoding alone."""
    from draftwise.draft_length import DraftLengthPolicy

    drafter = eagle_drafter if kind == "eagle" else medusa_drafter
    engine = Engine(smollm2, drafter, 24, DraftLengthPolicy())
    plain = Engine(smollm2)
    jobs = [(PROMPTS[i], SamplingParams(max_new_tokens=32), drafter, None) for i in (0, 3, 7, 9)]
    together = _decode_together(engine, jobs, join_steps=[0, 1, 1, 4])
    for (prompt, params, _, _), result in zip(jobs, together):
        assert result.token_ids == plain.generate(prompt, params).token_ids
    assert sum(r.metrics.num_accepted_tokens for r in together) > 0


@pytest.mark.parametrize("mode, draft_length", [("rejection", "fixed"), ("coupled", "adaptive")])
def test_seeded_sampling_gives_the_same_text_alone_or_in_a_batch(smollm2, mode, draft_length):
    """Each request samples from its own random stream, so its tokens are the same whatever
    else runs beside it: with rejection sampling when draft lengths are fixed (it draws random
    numbers per draft token, and adaptive lengths follow the load), with coupled sampling
    whatever the lengths."""
    from draftwise.draft_length import DraftLengthPolicy

    ngram = NgramDrafter(1, 3)
    engine = Engine(smollm2, ngram, 10, DraftLengthPolicy() if draft_length == "adaptive" else None)

    def params(i):
        return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_new_tokens=20, sampling_mode=mode)

    jobs = _jobs(params, ngram)
    together = _decode_together(engine, jobs, join_steps=[0, 2, 2, 0, 5, 1])
    for (prompt, p, drafter, num_draft), result in zip(jobs, together):
        alone = _decode_together(engine, [(prompt, p, drafter, num_draft)], join_steps=[0])[0]
        assert result.token_ids == alone.token_ids
    # Different seeds really differ (the test would pass vacuously if sampling ignored them).
    first = _decode_together(engine, [(PROMPTS[7], SamplingParams(temperature=1.0, seed=1, max_new_tokens=24), ngram, None)], [0])
    second = _decode_together(engine, [(PROMPTS[7], SamplingParams(temperature=1.0, seed=2, max_new_tokens=24), ngram, None)], [0])
    assert first[0].token_ids != second[0].token_ids


@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_a_shared_draft_model_drafts_for_the_whole_batch_at_once(smollm2, mode):
    """Requests whose drafters are forks of one draft model draft together: each draft forward
    runs once for all of them (the draft model sees several segments per forward), and every
    request's tokens are those it produces alone: greedy = plain greedy; seeded rejection
    sampling with fixed draft lengths (the draft's random draws come from each request's own
    stream, in the order they come alone)."""
    from draftwise.drafters import ModelDrafter

    draft_model = smollm2.model.truncated(12)
    segments_per_forward = []
    forward_batch = draft_model.forward_batch

    def counting(segments, hidden_layers=()):
        segments_per_forward.append(len(segments))
        return forward_batch(segments, hidden_layers)

    draft_model.forward_batch = counting
    drafter = ModelDrafter(draft_model)
    engine = Engine(smollm2, drafter, 4)

    def params(i):
        if mode == "greedy":
            return SamplingParams(max_new_tokens=20)
        return SamplingParams(temperature=0.8, seed=50 + i, max_new_tokens=20, sampling_mode="rejection")

    jobs = [(PROMPTS[i], params(i), drafter, [4, 2, 5, 3][n]) for n, i in enumerate((1, 4, 8, 10))]
    together = _decode_together(engine, jobs, join_steps=[0, 0, 2, 3])
    assert max(segments_per_forward) == 4  # all four drafted in one forward
    plain = Engine(smollm2)
    for (prompt, p, _, num_draft), result in zip(jobs, together):
        expected = plain.generate(prompt, p) if mode == "greedy" else _decode_together(engine, [(prompt, p, drafter, num_draft)], [0])[0]
        assert result.token_ids == expected.token_ids
    assert sum(r.metrics.num_accepted_tokens for r in together) > 0


def _chain(length: int, key: str) -> Draft:
    return Draft(torch.arange(length), None, key)


def test_controller_drafts_long_alone_less_under_load_and_nothing_when_it_cannot_pay():
    controller = BatchController()
    # A CPU-like cost curve: 1 row 10 ms, 16 rows 20 ms, then every row costs (weights re-read).
    for rows, ms in ((1, 10), (8, 15), (16, 20), (32, 40), (64, 80), (128, 160), (256, 320), (512, 640)):
        controller.observe_forward(rows, ms / 1000)
    policy = controller.new_policy()
    for _ in range(30):  # this kind of draft is almost always accepted
        policy.observe_verdict("good", 6, 6)

    def per_sequence(batch: int) -> list[int]:
        drafts = [(policy, _chain(6, "good")) for _ in range(batch)]
        return controller.allocate(drafts, num_fixed_rows=batch, num_fixed_tokens=batch).sizes

    assert per_sequence(1) == [6]  # alone: the whole draft pays
    four = per_sequence(4)
    assert 0 < sum(four) and max(four) - min(four) <= 1  # equal requests get equal shares
    means = [sum(per_sequence(batch)) / batch for batch in (1, 2, 4, 8, 16, 64)]
    assert means == sorted(means, reverse=True) and means[0] > means[2]  # less as the batch fills
    assert means[-1] == 0  # 64 rows already cost every row: no draft can pay
    # Unmeasured machine: measure a plain step first.
    assert BatchController().allocate([(policy, _chain(6, "good"))] * 4, 4, 4).sizes == [0] * 4


def test_controller_charges_drafts_beside_a_prefill_chunk_their_own_rows_not_the_chunks():
    controller = BatchController()
    # Past 16 rows every row costs (compute-bound), as beside a 128-row prefill chunk.
    for rows, ms in ((1, 10), (8, 15), (16, 20), (32, 40), (64, 80), (128, 160), (256, 320)):
        controller.observe_forward(rows, ms / 1000)
    policy = DraftLengthPolicy(forward_s=controller.forward_s)  # no pooled prior: the accounting alone
    for _ in range(30):  # the first draft token is nearly always accepted, the rest almost never
        policy.observe_verdict("first", 6, 1)
    drafts = [(policy, _chain(6, "first"))]
    alone = controller.allocate(drafts, 1, 1).sizes
    beside_chunk = controller.allocate(drafts, 1 + 128, 1, num_prefill_rows=128).sizes
    assert alone == [1]
    # Charging the chunk's 150 ms to one decoded token made five more rows at 1.25 ms each, for
    # about 0.2 expected tokens, look like a bargain; they are not.
    assert beside_chunk == alone
    assert controller.allocate(drafts, 1 + 128, 1).sizes == [6]  # what the old accounting chose


def test_a_request_starts_from_what_its_batch_mates_drafts_of_the_same_kind_did():
    controller = BatchController()
    first, joining = controller.new_policy(), controller.new_policy()
    fresh = BatchController().new_policy()
    assert joining.expected_gains("short", 1, None) == fresh.expected_gains("short", 1, None)
    for _ in range(20):  # the batch's drafts of this kind keep failing...
        first.observe_verdict("short", 4, 0)
        first.observe_verdict("long", 4, 4)  # ...and of that kind keep passing
    [short], [long] = joining.expected_gains("short", 1, None), joining.expected_gains("long", 1, None)
    [prior] = fresh.expected_gains("short", 1, None)
    assert short < 0.2 < prior < long  # without any verdict of its own
    joining.observe_verdict("short", 4, 4)  # its own evidence still moves it
    assert joining.expected_gains("short", 1, None)[0] > short


def test_controller_prefers_the_sequence_whose_drafts_get_accepted():
    controller = BatchController()
    for rows, ms in ((2, 10), (4, 12), (8, 20), (16, 40)):
        controller.observe_forward(rows, ms / 1000)
    good, poor = controller.new_policy(), controller.new_policy()
    for _ in range(30):
        good.observe_verdict("k", 4, 4)
        poor.observe_verdict("k", 4, 0)
    allocation = controller.allocate([(good, _chain(4, "k")), (poor, _chain(4, "k"))], 2, 2)
    assert allocation.sizes[0] > allocation.sizes[1]


def test_controller_extends_the_cost_curve_past_its_largest_forward_along_its_slope():
    """Past the largest forward measured (under load: a 128-row prefill chunk beside 16 decoding
    rows), rows cost what the measured curve's slope says, not nothing: taken as free, drafts
    rode along every prefill step and the controller fell below plain batching at 16 clients."""
    controller = BatchController()
    controller.observe_forward(1, 0.090)
    assert controller.cost(2) == controller.cost(1)  # one size measured: optimistic, so it is tried
    for rows, seconds in ((16, 0.120), (144, 0.555)):
        controller.observe_forward(rows, seconds)
    slope = (0.555 - 0.120) / (144 - 16)  # from the largest measured size at most half as big
    assert controller.cost(200) == pytest.approx(0.555 + 56 * slope)
    assert controller.cost(80) == pytest.approx(0.120 + (80 - 16) / 128 * (0.555 - 0.120))  # interpolated
    # drafts beside that chunk pay their rows (3.4 ms each): a rarely accepted draft is not worth
    # them, where "as cheap as the largest" made every row past 144 look free
    policy = DraftLengthPolicy(forward_s=controller.forward_s)
    for _ in range(30):
        policy.observe_verdict("weak", 6, 0)
    drafts = [(policy, _chain(6, "weak"))] * 16
    assert controller.allocate(drafts, 16 + 128, 16, num_prefill_rows=128).sizes == [0] * 16


def test_a_request_that_fails_to_start_gets_its_error_and_the_loop_serves_the_next(smollm2, monkeypatch):
    """An unexpected error while admitting one request (not a DraftwiseError) goes to that request;
    it once killed the scheduler's thread, and every later client waited forever."""
    import queue

    from draftwise.scheduler import Request, Scheduler

    engine = Engine(smollm2)
    real_start = engine.start
    broken = SamplingParams(max_new_tokens=4, seed=7)

    def start(prompt_ids, params, *rest):
        if params is broken:
            raise ValueError("a bug in starting this request")
        return real_start(prompt_ids, params, *rest)

    monkeypatch.setattr(engine, "start", start)
    events: dict[str, queue.Queue] = {"broken": queue.Queue(), "fine": queue.Queue()}
    scheduler = Scheduler(engine, max_batch=4).start()
    try:
        prompt_ids = engine.encode(PROMPTS[2])
        scheduler.submit(Request(prompt_ids, broken, events["broken"].put))
        assert isinstance(events["broken"].get(timeout=60).error, ValueError)
        scheduler.submit(Request(prompt_ids, SamplingParams(max_new_tokens=4), events["fine"].put))
        while (event := events["fine"].get(timeout=120)).result is None:
            assert event.error is None
        assert event.result.token_ids == engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=4)).token_ids
    finally:
        scheduler.stop()


def test_a_request_whose_drafter_raises_fails_alone_and_its_batch_mates_finish(smollm2):
    """A user's drafter that raises on one request: the Engine raises it to its caller; in a
    batch that request gets the error and the requests decoding beside it finish with the output
    they would have alone (such an error once failed the whole batch)."""
    import queue

    from draftwise.scheduler import Request, Scheduler

    class Flaky(NgramDrafter):
        poison: list[int] = []

        def propose(self, context, num_draft_tokens):
            if context[:len(self.poison)].tolist() == self.poison and context.shape[0] > len(self.poison) + 2:
                raise RuntimeError("the drafter broke on this request")
            return super().propose(context, num_draft_tokens)

    engine = Engine(smollm2, Flaky(1, 3), 5)
    Flaky.poison = engine.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=16)
    with pytest.raises(RuntimeError, match="broke on this request"):
        engine.generate(PROMPTS[0], params)
    scheduler = Scheduler(engine, max_batch=4)
    events = {index: queue.Queue() for index in (0, 2, 5)}
    for index, inbox in events.items():  # all waiting before the loop starts: one batch
        scheduler.submit(Request(engine.encode(PROMPTS[index]), params, inbox.put))
    scheduler.start()
    try:
        while (event := events[0].get(timeout=120)).error is None:
            assert event.result is None
        assert isinstance(event.error, RuntimeError)
        plain = Engine(smollm2)
        for index in (2, 5):
            while (event := events[index].get(timeout=120)).result is None:
                assert event.error is None
            assert event.result.token_ids == plain.generate(PROMPTS[index], params).token_ids
    finally:
        scheduler.stop()
