"""`draftwise train`: data (self-distillation), a draft vocabulary, the head, training, the files.

Two kinds of head: "eagle" (heads/eagle.py, the default) and "medusa" (heads/medusa.py).

Everything lands in one output folder: data.pt (the generated conversations and recorded hidden
states, so a resumed run, or the other kind of head, does not regenerate them),
checkpoint-KIND.pt (head, optimizer and progress, rewritten atomically every few minutes), and
the result, KIND/head.json + KIND/head.safetensors, which `--drafter KIND --head OUT/KIND`
loads. Rerunning the same command resumes where it stopped.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from draftwise.errors import ConfigError
from draftwise.heads.eagle import EagleConfig, EagleHead
from draftwise.heads.medusa import MedusaConfig, MedusaHeads
from draftwise.models import loading
from draftwise.output import make_output_folder
from draftwise.train import data as datagen
from draftwise.train.losses import eagle_loss, medusa_loss
from draftwise.train.trainer import (TrainSettings, TrainState, default_learning_rate, default_precision,
                                     draft_vocabulary, load_checkpoint, save_checkpoint, train)

KINDS = ("eagle", "medusa")


@dataclass(frozen=True, slots=True)
class DataSettings:
    num_questions: int = 1024  # Magpie questions the target writes (ignored with prompts_file)
    prompts_file: Path | None = None  # the user's own prompts (JSONL), instead of Magpie questions
    max_response_tokens: int = 160
    num_heldout: int = 12  # questions kept apart to measure acceptance during training
    draft_vocab_size: int = 8192
    batch_size: int = 128  # conversations generated at once
    seed: int = 0
    system_prompts: float = 0.0  # the fraction of questions written under a system prompt the target wrote
    follow_ups: float = 0.0  # the fraction of answered chats that get a follow-up question, answered too

    def __post_init__(self) -> None:
        if self.num_heldout < 1:
            raise ConfigError(f"num_heldout={self.num_heldout}: keep at least 1 question apart to measure acceptance.")
        if self.num_questions < self.num_heldout + 8 and self.prompts_file is None:
            raise ConfigError(f"num_questions={self.num_questions} is too few: use at least {self.num_heldout + 8}.")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be at least 1.")
        for name in ("system_prompts", "follow_ups"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)} is a fraction of the conversations: use 0 to 1.")
        if self.draft_vocab_size < 16:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} is too small: use 16 or more (e.g. 8192).")


def _bench_texts() -> set[str]:
    from draftwise.bench.suite import default_prompt_dir, load_suite

    folder = default_prompt_dir()
    if not folder.is_dir():
        return set()
    return {m.get("content", "").strip() for p in load_suite(folder) for m in p.messages}


def training_device(name: str) -> torch.device:
    """The device data generation and training run on: "cpu" (default), or "cuda" where PyTorch sees one."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: use cpu or cuda (cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this PyTorch sees no CUDA GPU (torch {torch.__version__}); "
                          "train on the CPU (--device cpu) or install a CUDA build of PyTorch.")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: training runs on cpu or cuda.")
    return device


def make_data(target, data_settings: DataSettings, layers: tuple[int, ...], progress: bool,
              device: torch.device = torch.device("cpu")) -> dict:
    """Questions, the target's answers and its hidden states; timings in seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    timings = {}
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target.folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # On the CPU draftwise's own decoder writes and answers (data.py); on a GPU transformers in bfloat16
    # (about 2x faster than float32 there), and the labels come from a float32 pass (_record).
    generator_model = target if device.type == "cpu" else \
        AutoModelForCausalLM.from_pretrained(loading.weights_folder(target, progress),
                                             dtype=torch.bfloat16).to(device).eval()
    if data_settings.prompts_file is not None:
        chats = datagen.read_prompts(data_settings.prompts_file)
    else:
        batch_size = min(data_settings.batch_size, data_settings.num_questions)
        systems = datagen.write_system_prompts(generator_model, tokenizer,
                                               round(data_settings.system_prompts * data_settings.num_questions),
                                               batch_size, data_settings.seed + 1, progress=progress)
        chats = datagen.write_questions(generator_model, tokenizer, data_settings.num_questions, batch_size,
                                        data_settings.seed, progress=progress, systems=systems)
        random.Random(data_settings.seed).shuffle(chats)  # held-out and follow-up picks from both kinds
    bench_texts = _bench_texts()
    chats, dropped = datagen.drop_bench_prompts(chats, bench_texts)
    timings["questions_s"] = time.perf_counter() - started
    if len(chats) <= data_settings.num_heldout:
        raise ConfigError(f"{len(chats)} prompts leave none to train on after holding out {data_settings.num_heldout}: "
                          "give more prompts or a smaller --heldout.")
    heldout, chats = chats[: data_settings.num_heldout], chats[data_settings.num_heldout:]
    # On the CPU the answering forwards record the hidden states as they go (data.HiddenRecorder).
    recording = layers if device.type == "cpu" else ()
    tic = time.perf_counter()
    conversations = datagen.answer(generator_model, tokenizer, chats, data_settings.max_response_tokens,
                                   data_settings.batch_size, progress=progress, layers=recording)
    timings["answers_s"] = time.perf_counter() - tic
    if data_settings.follow_ups > 0:
        tic = time.perf_counter()
        # Finished answers first (a follow-up to an answer cut at the length limit reads oddly).
        rng = random.Random(data_settings.seed)
        finished = [index for index, conversation in enumerate(conversations) if conversation.finished]
        unfinished = [index for index, conversation in enumerate(conversations) if not conversation.finished]
        rng.shuffle(finished)
        rng.shuffle(unfinished)
        picked = sorted((finished + unfinished)[: round(data_settings.follow_ups * len(chats))])
        answers = [tokenizer.decode(conversations[index].response_ids, skip_special_tokens=True).strip()
                   for index in picked]
        follow_ups = datagen.write_follow_ups(generator_model, tokenizer, [chats[index] for index in picked], answers,
                                              data_settings.batch_size, data_settings.seed + 2, progress=progress)
        follow_ups, dropped_too = datagen.drop_bench_prompts(follow_ups, bench_texts)
        dropped += dropped_too
        conversations += datagen.answer(generator_model, tokenizer, follow_ups, data_settings.max_response_tokens,
                                        data_settings.batch_size, progress=progress, layers=recording)
        timings["follow_ups_s"] = time.perf_counter() - tic
    # In order of length (recorded so on a GPU: batches pad less).
    conversations.sort(key=lambda conversation: len(conversation.prompt_ids) + len(conversation.response_ids))
    del generator_model
    tic = time.perf_counter()
    if recording:
        examples = [datagen.example_from_answer(conversation) for conversation in conversations]
    else:
        examples = _record(target, conversations, layers, progress, device)
        timings["hidden_states_s"] = time.perf_counter() - tic
    embed, lm_head = embedding_tables(loading.weights_folder(target, progress))
    return {"examples": examples, "layers": layers, "heldout": heldout, "embed": embed, "lm_head": lm_head,
            "timings": timings,
            "num_bench_prompts_dropped": dropped,
            "num_tokens": sum(e.tokens.shape[0] for e in examples),
            "num_answer_tokens": sum(e.tokens.shape[0] - e.num_prompt_tokens for e in examples)}


def embedding_tables(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head, [vocab, hidden] in float32, read from its
    safetensors alone: the tables the head trains against, without loading the whole model in
    float32 for them (Qwen2.5-Coder-1.5B on an AMD EPYC Zen 3: peak RSS 2.0 GB, the two tables,
    against 3.1 GB; 2.4-3.0 s against 8-10 s). Tied embeddings give the same table twice."""
    from safetensors import safe_open
    from transformers import AutoConfig

    names = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
    tables = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as file:
            for role, name in names.items():
                if name in file.keys():
                    tables[role] = file.get_tensor(name).float()
    if "embed" not in tables:
        raise ConfigError(f"{folder} holds no {names['embed']}: heads train on llama- or qwen2-style checkpoints, "
                          "whose safetensors name their tensors so.")
    if "lm_head" not in tables:
        if not AutoConfig.from_pretrained(folder).tie_word_embeddings:
            raise ConfigError(f"{folder} holds no {names['lm_head']} and does not tie its embeddings: the "
                              "checkpoint is incomplete; convert the model again.")
        tables["lm_head"] = tables["embed"]
    return tables["embed"], tables["lm_head"]


def acceptance_on(target, drafter_factory, chats: list, max_new_tokens: int = 64, num_nodes: int = 16) -> dict:
    """Mean accepted length (tokens committed per target forward) of greedy decoding with the
    head's drafter verifying num_nodes-node trees, on chats the head never trained on."""
    from draftwise.config import SamplingParams
    from draftwise.engine import Engine

    engine = Engine(target, drafter_factory(), num_nodes)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    committed = forwards = 0
    for chat in chats:
        metrics = engine.generate(chat, params).metrics
        committed += metrics.num_committed_tokens
        forwards += metrics.num_target_forwards
    return {"mean_accepted_length": round(committed / max(1, forwards), 3)}


def _features_for(bundle: dict, target, layers: tuple[int, ...], progress: bool,
                  device: torch.device) -> list[datagen.Example]:
    """The bundle's conversations with hidden states at `layers`: recorded again if it holds others."""
    recorded = tuple(bundle.get("layers", ()))
    if recorded == layers:
        return bundle["examples"]
    if set(layers) <= set(recorded):  # a subset: slice the recorded features
        hidden = bundle["examples"][0].features.shape[1] // len(recorded)
        columns = torch.cat([torch.arange(recorded.index(l) * hidden, (recorded.index(l) + 1) * hidden) for l in layers])
        return [replace(e, features=e.features[:, columns]) for e in bundle["examples"]]
    conversations = [datagen.Conversation(e.tokens[: e.num_prompt_tokens].tolist(), e.tokens[e.num_prompt_tokens:].tolist())
                     for e in bundle["examples"]]
    return _record(target, conversations, layers, progress, device)


def _record(target, conversations: list, layers: tuple[int, ...], progress: bool,
            device: torch.device) -> list[datagen.Example]:
    """The hidden states and labels of finished conversations (make_data on a GPU, and a bundle
    recorded at other layers; make_data on the CPU records them while answering): on the CPU from
    draftwise's own decoder (what the head reads at run time, and faster: on the AMX Xeon, 2
    threads, SmolLM2's 256 conversations in 25 s against 71 s through transformers in float32,
    Qwen2.5-Coder-1.5B's 48 in 24-26 s against 132; labels agree at 99.6% of positions), on a GPU
    from transformers in float32."""
    if device.type == "cpu":
        return datagen.record_features_native(target.model, conversations, layers, progress=progress)
    from transformers import AutoModelForCausalLM

    folder = loading.weights_folder(target, progress)
    scoring_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    return datagen.record_features(scoring_model, conversations, layers, batch_size=16, progress=progress)


def train_head(target_name: str, output: Path, data_settings: DataSettings = DataSettings(),
               settings: TrainSettings = TrainSettings(), kind: str = "eagle", progress: bool = True,
               device: str = "cpu", intermediate_size: int | None = None, restart: bool = False) -> Path:
    """Make (or reuse) the data, train a head of this kind and write it to output/kind. On a CUDA
    device the target's generation, its hidden states and the head's training run there; the
    held-out acceptance is measured on the CPU, through draftwise's own decoder, as users run it.
    intermediate_size: the EAGLE head's MLP width (default: the target's). restart: a new head
    from step 0 on output's data, its checkpoint ignored (and overwritten); else a checkpoint
    there is resumed."""
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is not a head kind: use one of {', '.join(KINDS)}.")
    train_on = training_device(device)
    with _tf32_matmuls(train_on):
        return _train_head(target_name, Path(output), data_settings, settings, kind, progress, train_on,
                           intermediate_size, restart)


@contextmanager
def _tf32_matmuls(device: torch.device):
    """On CUDA, float32 matrix products through the GPU's matrix units (TF32: ~1e-3 relative, well
    inside what a head sees at run time from a bf16-activation target; several times faster for
    the scoring passes), and the process's own setting back afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = before or device.type == "cuda"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _train_head(target_name: str, output: Path, data_settings: DataSettings, settings: TrainSettings, kind: str,
                progress: bool, train_on: torch.device, intermediate_size: int | None, restart: bool) -> Path:
    import copy

    from draftwise.drafters.eagle import EagleDrafter
    from draftwise.drafters.medusa import MedusaDrafter

    loading.check_findable(target_name)  # a mistyped target leaves no output folder behind
    make_output_folder(output, "the data, the checkpoint and the head")
    target = loading.load(target_name, dtype="auto", progress=progress)
    if not hasattr(target.model, "shape"):
        raise ConfigError(f"{target_name} runs through the transformers fallback: heads need the native decoder "
                          "(llama, qwen2, mistral architectures).")
    vocab_size = data_settings.draft_vocab_size
    if kind == "eagle":
        layers = EagleConfig.for_target(target.model, target_name, vocab_size).hidden_layers
    else:
        layers = MedusaConfig.for_target(target.model, target_name, vocab_size, settings.ttt_steps).hidden_layers
    data_path = output / "data.pt"
    if data_path.is_file():
        bundle = torch.load(data_path, weights_only=False)
        bundle.setdefault("layers", EagleConfig.for_target(target.model, target_name, vocab_size).hidden_layers)
        if progress:
            print(f"reusing {len(bundle['examples'])} conversations from {data_path}")
    else:
        bundle = make_data(target, data_settings, layers, progress, train_on)
        torch.save(bundle, data_path)
    examples, embed = _features_for(bundle, target, layers, progress, train_on), bundle["embed"].to(train_on)
    vocabulary = draft_vocabulary(examples, min(vocab_size, embed.shape[0]), always=list(target.model.info.eos_token_ids))
    torch.manual_seed(settings.seed)
    if kind == "eagle":
        config = replace(EagleConfig.for_target(target.model, target_name, vocabulary.shape[0], intermediate_size),
                         vocab_by_frequency=True)  # draft_vocabulary's order
        head = EagleHead(config)
    else:
        config = MedusaConfig.for_target(target.model, target_name, vocabulary.shape[0], settings.ttt_steps)
        head = MedusaHeads(config)
    if settings.learning_rate is None:
        settings = replace(settings, learning_rate=default_learning_rate(config.hidden_size))
    if settings.precision == "auto":
        settings = replace(settings, precision=default_precision(train_on))
    head.draft_to_target.copy_(vocabulary)  # before the loss maps labels through it
    with torch.no_grad():
        head.lm_head.weight.copy_(bundle["lm_head"][vocabulary])  # the target's own LM head rows ...
    head.lm_head.weight.requires_grad_(False)  # ... kept as they are (as EAGLE does): 15% faster steps here
    head.to(train_on)
    on_cpu = lambda: copy.deepcopy(head).cpu()  # noqa: E731  (what the drafters run, for the held-out measure)
    if kind == "eagle":
        loss_fn = eagle_loss(head, embed, settings.ttt_steps)
        # A generous tree (8 children x 6 deep, every level grown, no prompt lookup) measures what
        # the head knows, not what a step can afford.
        drafter_factory = lambda: EagleDrafter(on_cpu(), target.model, top_k=8, depth=6,  # noqa: E731
                                               min_path_probability=0.0, lookup=0)
    else:
        loss_fn = medusa_loss(head, embed.shape[0])
        drafter_factory = lambda: MedusaDrafter(on_cpu(), target.model, lookup=0)  # noqa: E731  (the heads alone)
    checkpoint = output / f"checkpoint-{kind}.pt"
    state = load_checkpoint(checkpoint, head) if checkpoint.is_file() and not restart else TrainState()

    def save(state: TrainState, optimizer_state: dict) -> None:
        save_checkpoint(checkpoint, head, state, optimizer_state)

    # The held-out answers run as long as the training answers, up to 64 tokens.
    heldout_tokens = min(64, data_settings.max_response_tokens)
    state = train(head, loss_fn, examples, settings, state, save,
                  lambda: acceptance_on(target, drafter_factory, bundle["heldout"], heldout_tokens), progress=progress)
    head.config = replace(config, training={
        "conversations": len(examples), "tokens": bundle["num_tokens"], "answer_tokens": bundle["num_answer_tokens"],
        "data_timings_s": {k: round(v, 1) for k, v in bundle["timings"].items()},
        "train_s": round(state.elapsed_s, 1), "steps": state.step, "epochs": settings.epochs,
        "sequences_per_step": settings.sequences_per_step, "sequences_per_forward": settings.sequences_per_forward,
        "epochs_trained": round(state.step * settings.sequences_per_step / len(examples), 2),
        "max_train_s": settings.max_train_s,
        "ttt_steps": settings.ttt_steps, "learning_rate": settings.learning_rate, "precision": settings.precision,
        "curve": state.curve,
        "bench_prompts_dropped": bundle["num_bench_prompts_dropped"], "device": device_name(train_on),
    })
    return head.cpu().save(output / kind)


def device_name(device: torch.device) -> str:
    """What the head's record says it was trained on."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"
