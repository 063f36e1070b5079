"""`draftwise train` end to end on a tiny budget: data from the user's prompts, answers and hidden
states from the real SmolLM2, a head trained, checkpointed, resumed and loaded by its drafter."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from draftwise.cli import main
from draftwise.config import SamplingParams
from draftwise.drafters.eagle import EagleDrafter
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.heads.eagle import load_head
from draftwise.heads.medusa import load_medusa
from draftwise.train.data import drop_bench_prompts, read_prompts

PROMPTS = ["What is the capital of Italy?", "Name three colours.", "How many legs does a spider have?",
           "Write a haiku about snow.", "What is 12 plus 30?", "Translate 'good night' to Spanish.",
           "Give me a synonym for happy.", "Why is the sky blue?", "List two prime numbers.",
           "What do bees make?", "Say hello in French.", "What is the opposite of cold?"]


def _train_args(folder, out) -> list[str]:
    """The fixture's `draftwise train` arguments (its prompts written into folder)."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return ["--target", "smollm2-135m", "--out", str(out), "--prompts", str(prompts),
            "--max-response-tokens", "24", "--draft-vocab", "512", "--heldout", "2", "--quiet",
            "--head-intermediate-size", "256", "--follow-ups", "0.5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    common = _train_args(folder, folder / "out")
    assert main(["train", *common, "--epochs", "1"]) == 0
    first = json.loads((folder / "out" / "eagle" / "head.json").read_text())["training"]
    # Rerunning with more epochs resumes from the checkpoint instead of starting over.
    assert main(["train", *common, "--epochs", "2"]) == 0
    second = json.loads((folder / "out" / "eagle" / "head.json").read_text())["training"]
    assert main(["train", *common, "--kind", "medusa", "--epochs", "1"]) == 0
    return folder / "out", first, second


def test_training_writes_a_head_with_its_record_and_resumes(trained, smollm2_tokenizer):
    out, first, second = trained
    assert (out / "data.pt").is_file() and (out / "checkpoint-eagle.pt").is_file()
    assert second["steps"] > first["steps"] > 0
    assert second["curve"][: len(first["curve"])] == first["curve"]  # the first run's points were kept
    assert all(point["mean_accepted_length"] >= 1.0 for point in second["curve"])
    # Two held out to measure acceptance; half of the other ten answered, followed up and answered again.
    assert second["conversations"] == len(PROMPTS) - 2 + 5
    opening = smollm2_tokenizer.encode("<|im_start|>user", add_special_tokens=False)  # a user turn's first tokens
    user_turns = [sum(e.tokens[i: i + len(opening)].tolist() == opening for i in range(e.num_prompt_tokens))
                  for e in torch.load(out / "data.pt", weights_only=False)["examples"]]
    assert sorted(user_turns) == [1] * 10 + [2] * 5
    head = json.loads((out / "eagle" / "head.json").read_text())
    assert head["intermediate_size"] == 256  # --head-intermediate-size, not SmolLM2's own 1536
    assert second["learning_rate"] == 1e-3  # the default for a 576-wide head


def test_restart_trains_a_new_head_on_the_same_data(trained, tmp_path):
    """A finished run rerun resumes and trains no more; --restart starts a head from step 0 on
    the same data.pt (kept, not made again) and replaces the checkpoint."""
    out, first, second = trained
    copy_of = tmp_path / "out"
    shutil.copytree(out, copy_of)
    data_written = (copy_of / "data.pt").stat().st_mtime_ns
    common = _train_args(tmp_path, copy_of)
    assert main(["train", *common, "--epochs", "2"]) == 0  # finished: nothing more to train
    again = json.loads((copy_of / "eagle" / "head.json").read_text())["training"]
    assert again["steps"] == second["steps"] and again["curve"] == second["curve"]
    assert main(["train", *common, "--epochs", "1", "--restart"]) == 0
    restarted = json.loads((copy_of / "eagle" / "head.json").read_text())["training"]
    assert restarted["steps"] == first["steps"] < second["steps"]  # one epoch, from step 0
    assert len(restarted["curve"]) == len(first["curve"])  # a curve of its own, not the old one's tail
    assert (copy_of / "data.pt").stat().st_mtime_ns == data_written
    assert torch.load(copy_of / "checkpoint-eagle.pt", weights_only=False)["state"]["step"] == first["steps"]


def test_magpie_writes_system_prompts_questions_under_them_and_follow_ups(smollm2, smollm2_tokenizer):
    """On draftwise's decoder (the CPU's); a GPU's transformers decoder writes through the same code
    but for _generate, which the next test checks against this one."""
    from draftwise.train.data import write_follow_ups, write_questions, write_system_prompts

    model = smollm2
    tokenizer = copy.deepcopy(smollm2_tokenizer)  # the session's own keeps its padding side
    tokenizer.padding_side = "left"  # as make_data sets it for generation
    systems = write_system_prompts(model, tokenizer, 2, batch_size=4, seed=0, progress=False)
    assert len(systems) == 2 and all(system.startswith("You are") for system in systems)
    assert systems[0] != systems[1]  # distinct: the model keeps writing until each is new
    chats = write_questions(model, tokenizer, 3, batch_size=4, seed=0, progress=False, systems=systems[:1])
    assert [[m["role"] for m in chat] for chat in chats] == [["system", "user"], ["user"], ["user"]]
    assert chats[0][0]["content"] == systems[0] and len({chat[-1]["content"] for chat in chats}) == 3
    follow_ups = write_follow_ups(model, tokenizer, chats[1:], ["Paris.", "Blue."], batch_size=4, seed=0,
                                  progress=False)
    assert [[m["role"] for m in chat] for chat in follow_ups] == [["user", "assistant", "user"]] * 2
    assert [chat[1]["content"] for chat in follow_ups] == ["Paris.", "Blue."]  # the answer each follows
    assert all(len(chat[2]["content"]) >= 12 for chat in follow_ups)


def test_writing_through_transformers_continues_each_text_as_the_native_decoder_does(smollm2, hf_smollm2,
                                                                                     smollm2_tokenizer):
    """make_data on a GPU writes through transformers' generate: a left-padded batch of texts of
    different lengths continues each one greedily exactly as draftwise's decoder does, and a row
    that ends early ends with its end-of-sequence token, as the native rows do."""
    from draftwise.train.data import _generate

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.padding_side = "left"  # as make_data sets it for generation
    texts = ["<|im_start|>user\nAnswer with one word: what colour is the sky?<|im_end|>\n<|im_start|>assistant\n",
             "The capital of France is", "def add(a, b):\n    return"]
    through_transformers = _generate(hf_smollm2, tokenizer, texts, 12, sample=False)
    natively = _generate(smollm2, tokenizer, texts, 12, sample=False)
    eos = tokenizer.eos_token_id
    cut = [row[: row.index(eos) + 1] if eos in row else row for row in through_transformers]  # generate pads after it
    assert cut == natively
    assert eos in natively[0] and all(len(row) == 12 for row in natively[1:])


def test_fractions_of_conversations_outside_zero_to_one_are_refused():
    from draftwise.train.pipeline import DataSettings

    with pytest.raises(ConfigError, match="follow_ups=1.5"):
        DataSettings(follow_ups=1.5)
    with pytest.raises(ConfigError, match="system_prompts=-0.1"):
        DataSettings(system_prompts=-0.1)


def test_the_default_learning_rate_is_lower_for_wide_heads():
    from draftwise.train.trainer import default_learning_rate

    assert default_learning_rate(576) == 1e-3  # SmolLM2: measured to train well
    assert default_learning_rate(1536) == 2e-4  # Qwen2.5-Coder-1.5B: 1e-3 diverged


def test_a_head_narrower_than_one_unit_is_refused(smollm2):
    from draftwise.heads.eagle import EagleConfig

    assert EagleConfig.for_target(smollm2.model, "smollm2-135m", 512).intermediate_size == 1536
    with pytest.raises(ConfigError, match="intermediate_size=0"):
        EagleConfig.for_target(smollm2.model, "smollm2-135m", 512, intermediate_size=0)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_trained_heads_load_and_draft_losslessly(trained, smollm2, kind):
    out, _, _ = trained
    drafter = EagleDrafter(load_head(out / "eagle", smollm2.model), smollm2.model) if kind == "eagle" else \
        MedusaDrafter(load_medusa(out / "medusa", smollm2.model), smollm2.model)
    params = SamplingParams(max_new_tokens=20)
    prompt = [{"role": "user", "content": "Tell me about cats."}]
    expected = Engine(smollm2).generate(prompt, params).token_ids
    assert Engine(smollm2, drafter, 12).generate(prompt, params).token_ids == expected


def test_bench_prompts_are_never_training_data(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "keep me"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "bench"}]}) + "\n")
    kept, dropped = drop_bench_prompts(read_prompts(path), {"bench"})
    assert kept == [[{"role": "user", "content": "keep me"}]] and dropped == 1


@pytest.mark.parametrize("line, problem", [
    ('{"text": "no"}', "prompt"),
    ('{"prompt": ["a", "list"]}', "not text"),
    ('["a", "list"]', "not an object"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', "content"),
    ('{"prompt": ', "Expecting value"),
])
def test_a_malformed_prompts_file_is_refused_with_its_line(tmp_path, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"p.jsonl:2 .*{problem}"):
        read_prompts(path)



def test_an_output_that_is_a_file_or_a_mistyped_target_is_refused_before_any_work(tmp_path, capsys):
    """--out naming a file ended in a FileExistsError traceback; a mistyped target left an empty
    output folder behind. Both are now one line, before the target loads."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["train", "--out", str(a_file), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a file: give --out a folder" in err and "Traceback" not in err
    assert a_file.read_text() == "mine"
    assert main(["train", "--target", "smollm2-135n", "--out", str(tmp_path / "head"), "--quiet"]) == 2
    assert "unknown model 'smollm2-135n'" in capsys.readouterr().err
    assert not (tmp_path / "head").exists()

def test_a_head_for_another_target_is_refused(trained, qwen_0_5b):
    out, _, _ = trained
    with pytest.raises(ConfigError, match="trained for 'smollm2-135m'"):
        load_head(out / "eagle", qwen_0_5b.model)
    with pytest.raises(ConfigError, match="not a draft head"):
        load_head(out, qwen_0_5b.model)  # the output folder itself holds no head.json


def test_losses_map_labels_through_the_vocabulary_the_head_has_when_scoring(smollm2):
    # A head whose draft vocabulary is set AFTER its loss function was made must still be
    # trained on labels in that vocabulary (the order the pipeline once got wrong).
    from draftwise.heads.eagle import EagleConfig, EagleHead
    from draftwise.train.data import Example
    from draftwise.train.losses import eagle_loss

    head = EagleHead(EagleConfig.for_target(smollm2.model, "smollm2-135m", 16))
    embed = torch.randn(smollm2.model.shape.vocab_size, smollm2.model.shape.hidden_size)
    loss_fn = eagle_loss(head, embed, ttt_steps=1)
    labels = torch.tensor([40000 + i for i in range(8)])  # ids far outside an identity map of 16
    example = Example(torch.arange(8), torch.zeros(8, 3 * smollm2.model.shape.hidden_size, dtype=torch.bfloat16),
                      labels, num_prompt_tokens=1)
    head.draft_to_target.copy_(torch.arange(40000, 40016))
    _, counts = loss_fn([example])
    assert counts[0][1] == 7  # rows 0..6 score labels 1..7, all in the vocabulary (an identity map counts none)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_padded_batch_learns_what_its_sequences_teach_alone(smollm2, kind):
    # Sequences of different lengths in one forward (the GPU's way to train): each one's rows
    # must compute what they compute alone, padding seen by none of them and scored nowhere.
    from draftwise.heads.eagle import EagleConfig, EagleHead
    from draftwise.heads.medusa import MedusaConfig, MedusaHeads
    from draftwise.train.data import Example
    from draftwise.train.losses import eagle_loss, medusa_loss

    torch.manual_seed(0)
    shape = smollm2.model.shape
    vocab = 4  # a draft vocabulary of 4: about a quarter of the guesses right, so there are rights to compare
    if kind == "eagle":
        head = EagleHead(EagleConfig.for_target(smollm2.model, "smollm2-135m", vocab))
        embed = torch.randn(shape.vocab_size, shape.hidden_size)
        make_loss = lambda steps: eagle_loss(head, embed, ttt_steps=steps)  # noqa: E731
        width = 3 * shape.hidden_size
    else:
        heads = {steps: MedusaHeads(MedusaConfig.for_target(smollm2.model, "smollm2-135m", vocab, steps))
                 for steps in (1, 4)}
        for head in heads.values():
            for block in head.blocks:  # not the zero start: each head must draft its own way
                torch.nn.init.normal_(block.weight, std=0.05)
        make_loss = lambda steps: medusa_loss(heads[steps], shape.vocab_size)  # noqa: E731
        width = shape.hidden_size
    examples = [Example(torch.randint(1000, (length,)), torch.randn(length, width).bfloat16(),
                        torch.randint(vocab, (length,)), num_prompt_tokens=prompt)
                for length, prompt in [(23, 5), (9, 3), (17, 16)]]
    for steps in (1, 4):
        loss_fn = make_loss(steps)
        batched_loss, batched_counts = loss_fn(examples)
        alone = [loss_fn([example]) for example in examples]
        # Per draft depth, the same predictions right out of the same positions counted.
        summed = [tuple(sum(counts[depth][i] for _, counts in alone) for i in (0, 1))
                  for depth in range(len(batched_counts))]
        assert batched_counts == summed and summed[0][0] > 0
        if steps == 1:  # one depth: the batch's mean is the positions' mean
            weighted = sum(loss * counts[0][1] for loss, counts in alone) / summed[0][1]
            assert torch.allclose(batched_loss, weighted, rtol=1e-5)
        # Training in bfloat16 (autocast) pads rows to a bucket, in the batch and through the LM
        # head: the same positions counted, the same loss up to bfloat16's rounding.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded_loss, rounded_counts = loss_fn(examples)
        assert [count for _, count in rounded_counts] == [count for _, count in batched_counts]
        assert torch.allclose(rounded_loss.float(), batched_loss, rtol=2e-2)


def test_a_time_budget_fits_the_schedule_to_the_steps_that_fit(monkeypatch):
    """--max-minutes: the schedule is fitted to the measured time a step (again once the slow
    first steps are behind) and training stops at the budget. A fake clock that each sequence
    advances keeps this independent of the machine."""
    import draftwise.train.trainer as trainer
    from draftwise.train.data import Example

    clock = [0.0]
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock[0])
    weight = torch.nn.Parameter(torch.ones(3))
    head = torch.nn.Module()
    head.weight = weight
    calls = [0]

    def loss_fn(example):
        calls[0] += 1
        clock[0] += 0.05 if calls[0] <= 5 else 0.01  # the warmup's steps are slow, as on a GPU
        return (weight ** 2).sum(), []

    examples = [Example(torch.zeros(2, dtype=torch.long), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), 1)] * 8
    settings = trainer.TrainSettings(epochs=1000, learning_rate=1e-2, warmup_steps=5, sequences_per_step=1,
                                     checkpoint_every_s=1e9, max_train_s=2.0)
    state = trainer.train(head, loss_fn, examples, settings, trainer.TrainState(), lambda *_: None, None,
                          progress=False)
    # 5 slow steps take 0.25 s; the other 1.75 s fit 175 steps of 0.01 s (a fit from the first
    # steps alone would have stopped at 40 steps).
    assert abs(state.step - 180) <= 2 and state.total_steps == state.step
    assert abs(state.elapsed_s - 2.0) <= 0.03
    assert state.fits == 2
    assert trainer.TrainSettings(max_train_s=None).max_train_s is None
    with pytest.raises(ConfigError, match="positive"):
        trainer.TrainSettings(max_train_s=0)


def test_training_on_a_missing_gpu_is_refused_clearly():
    from draftwise.train.pipeline import training_device

    assert training_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            training_device("cuda")
    with pytest.raises(ConfigError, match="not a device"):
        training_device("gpu0")


def test_tf32_for_training_on_a_gpu_is_undone_afterwards():
    """The scoring passes use TF32 on CUDA; a program that trains a head keeps its own setting after."""
    from draftwise.train.pipeline import _tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32
    with _tf32_matmuls(torch.device("cuda")):
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before
    with _tf32_matmuls(torch.device("cpu")):
        assert torch.backends.cuda.matmul.allow_tf32 == before


def _conversations(tokenizer, count: int):
    from draftwise.train.data import Conversation

    conversations = []
    for number, prompt in enumerate(PROMPTS[:count]):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        answer = tokenizer.encode(f" Answer number {number}: it depends on the details.", add_special_tokens=False)
        conversations.append(Conversation(tokenizer.encode(rendered, add_special_tokens=False), answer))
    return conversations


def test_hidden_states_from_the_native_decoder_are_transformers_own_and_do_not_depend_on_packing(smollm2,
                                                                                                  hf_smollm2):
    """The CPU records the head's inputs through draftwise's decoder (what the head reads at run
    time): in float32 they are transformers' hidden states up to summation order, the labels its
    argmax, and a conversation's rows are the same bits whether packed with others or alone."""
    from draftwise.heads.eagle import EagleConfig
    from draftwise.train.data import record_features, record_features_native

    layers = EagleConfig.for_target(smollm2.model, "smollm2-135m", 512).hidden_layers
    conversations = _conversations(smollm2.tokenizer, 5)
    native = record_features_native(smollm2.model, conversations, layers, progress=False)  # packed: one forward
    reference = record_features(hf_smollm2, conversations, layers, batch_size=5, progress=False)
    alone = [record_features_native(smollm2.model, [c], layers, progress=False)[0] for c in conversations[:2]]
    for mine, theirs in zip(native, reference):
        assert torch.equal(mine.tokens, theirs.tokens) and mine.num_prompt_tokens == theirs.num_prompt_tokens
        assert mine.features.shape == theirs.features.shape and mine.features.dtype == torch.bfloat16
        cosine = torch.nn.functional.cosine_similarity(mine.features.float(), theirs.features.float(), dim=-1)
        assert cosine.min() > 0.999, cosine.min()
        assert (mine.labels == theirs.labels).float().mean() > 0.95
    for single, packed in zip(alone, native):
        assert torch.equal(single.features, packed.features) and torch.equal(single.labels, packed.labels)


def test_hidden_states_recorded_while_answering_are_a_second_passes_own(smollm2, smollm2_tokenizer):
    """On the CPU the answering forwards record the head's inputs as they go (HiddenRecorder)
    instead of a second pass over the finished conversations: the same bits as that pass (batch
    invariance: a prompt row at prefill and a token fed alone compute alike, whatever else the
    forward holds), and the answer's tokens are that pass's argmax, the labels it would give."""
    from draftwise.heads.eagle import EagleConfig
    from draftwise.train.data import Conversation, answer, example_from_answer, record_features_native

    layers = EagleConfig.for_target(smollm2.model, "smollm2-135m", 512).hidden_layers
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[:5]]
    conversations = answer(smollm2, smollm2_tokenizer, chats, 20, batch_size=3, progress=False, layers=layers)
    # Three at a time, the next starting as one finishes: the answers all five at once give.
    assert [c.response_ids for c in conversations] == [
        c.response_ids for c in answer(smollm2, smollm2_tokenizer, chats, 20, batch_size=5, progress=False)]
    assert any(c.finished for c in conversations) and any(not c.finished for c in conversations)
    recorded = [example_from_answer(c) for c in conversations]
    replayed = record_features_native(smollm2.model, [Conversation(c.prompt_ids, c.response_ids[:-1])
                                                      for c in conversations], layers, progress=False)
    for mine, second in zip(recorded, replayed):
        assert torch.equal(mine.tokens, second.tokens) and mine.num_prompt_tokens == second.num_prompt_tokens
        assert mine.features.dtype == torch.bfloat16 and torch.equal(mine.features, second.features)
        answer_rows = slice(mine.num_prompt_tokens - 1, None)  # the positions the head learns
        assert torch.equal(mine.labels[answer_rows], second.labels[answer_rows])
    with pytest.raises(ValueError, match="rows recorded"):  # an answer whose rows were lost is refused
        example_from_answer(Conversation(conversations[0].prompt_ids, conversations[0].response_ids,
                                         features=conversations[0].features[:-1]))


def test_the_embedding_tables_are_read_from_the_checkpoint_alone(smollm2, hf_smollm2):
    """make_data takes the embedding and the LM head the head trains against from the safetensors
    file, not from the whole model loaded in float32: the same values transformers gives."""
    from draftwise.models import loading
    from draftwise.train.pipeline import embedding_tables

    embed, lm_head = embedding_tables(loading.weights_folder(smollm2, progress=False))
    assert embed.dtype == torch.float32 and embed.shape == (smollm2.model.shape.vocab_size,
                                                             smollm2.model.shape.hidden_size)
    assert torch.equal(embed, hf_smollm2.get_input_embeddings().weight)
    assert torch.equal(lm_head, hf_smollm2.get_output_embeddings().weight)  # tied: the same table


def test_untied_embedding_tables_are_told_apart_and_a_missing_lm_head_is_refused(tmp_path):
    """A target with an LM head of its own (tiny random llama: the names are what is tested) gives
    that head, not the embedding; a checkpoint that lost it is refused, not trained against the
    embedding by mistake."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from draftwise.train.pipeline import embedding_tables

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    embed, lm_head = embedding_tables(tmp_path)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(lm_head, model.get_output_embeddings().weight) and not torch.equal(embed, lm_head)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lm_head.weight"):
        embedding_tables(tmp_path)


def test_the_draft_vocabulary_lists_the_answers_tokens_most_frequent_first():
    """draft_vocabulary's order is what lets a drafter keep a prefix (EagleDrafter's draft_vocab):
    the answers' most frequent token first, prompt tokens not counted, `always` ids kept in front,
    ties by id."""
    from draftwise.train.data import Example
    from draftwise.train.trainer import draft_vocabulary

    def example(labels: list[int], prompt: int) -> Example:
        n = len(labels)
        return Example(torch.arange(n), torch.zeros(n, 1), torch.tensor(labels), num_prompt_tokens=prompt)

    # answer labels (from index prompt - 1 on, the last prompt position predicting the answer's
    # first token): 5 x3, 9 x2, 7 x2, 4 x1; the 8s before them never count
    examples = [example([8, 8, 5, 5, 9, 7], prompt=3), example([5, 9, 7, 4], prompt=1)]
    assert draft_vocabulary(examples, 4, always=[]).tolist() == [5, 7, 9, 4]
    assert draft_vocabulary(examples, 3, always=[2]).tolist() == [2, 5, 7]
