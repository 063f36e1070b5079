"""Builds the methods to compare and times them on a prompt suite, side by side in one process."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tqdm.auto import tqdm

from draftwise.bench.methods import DraftwiseMethod, LlamaCppMethod, Method, TransformersMethod
from draftwise.bench.suite import BenchPrompt
from draftwise.config import SpecConfig
from draftwise import engine_for
from draftwise.drafters import DRAFTERS, build_drafter, check_before_loading
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.kv_cache import check_kv_cache
from draftwise.models import loading, registry
from draftwise.models.linear import check_activations, check_quantize
from draftwise.models.loading import LoadedModel

PLAIN = "draftwise plain"  # float weights, plain greedy: the reference of every float-weight method
TRANSFORMERS_PROMPT_LOOKUP = "transformers prompt lookup"
TRANSFORMERS_UNIVERSAL_ASSISTED = "transformers universal assisted"
LLAMA_CPP_PLAIN = "llama.cpp plain"
HEAD_DRAFTERS = ("eagle", "medusa")  # the drafters --heads gives a head
LLAMA_CPP_INSTALL = ("pip install llama-cpp-python, or the extra '.[llamacpp]' (optional; it compiles llama.cpp, about 5 minutes on "
                     "2 cores; see the README for the build flags this machine needs)")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "smollm2-135m"
    draft_model: str | None = None
    dtype: str = "auto"
    num_draft_tokens: int | None = None  # None: each drafter's default ceiling
    draft_length: str = "adaptive"
    prompt_lookup_num_tokens: int = 10  # transformers' and llama.cpp's prompt lookup, as their docs suggest
    max_new_tokens: int = 128
    repeats: int = 3
    with_transformers: bool = True
    # transformers' dtype: None follows dtype (auto -> float32); "bfloat16" is its fastest on
    # CPUs with AVX-512 BF16 (the baseline), whatever draftwise's weights are.
    transformers_dtype: str | None = None
    with_llama_cpp: bool = True  # when llama-cpp-python is installed and the model has a GGUF file
    quantize: tuple[str, ...] = ()  # extra rows: draftwise plain and ngram with these weight formats
    activations: str = "auto"  # the main draftwise rows' (loading.load's; "auto" resolved in the report's title)
    kv_cache: str = "auto"  # what every draftwise row's KV caches store (loading.load's)
    activation_rows: tuple[str, ...] = ()  # extra rows: plain and each drafter (ngram, model, eagle, medusa) on the same weights, these activations
    threads: int | None = None  # None: torch's current setting
    cross_vocab_draft: str | None = None  # a draft model with another tokenizer (cross-vocab rows, transformers UAG)
    cross_vocab_methods: tuple[str, ...] = ("auto",)  # a cross-vocab row per method
    drafters: tuple[str, ...] | None = None  # draftwise drafters to run (None: every registered one); plain always runs
    heads: str | None = None  # a `draftwise train --out` folder: its eagle/ and medusa/ heads (None: the shipped ones)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"repeats={self.repeats}, max_new_tokens={self.max_new_tokens}: both must be at least 1.")
        if self.transformers_dtype is not None:
            loading.parse_dtype(self.transformers_dtype)  # a ConfigError naming the choices
        for name in self.quantize:
            check_quantize(name)
        for name in (self.activations, *self.activation_rows):
            check_activations(name)
        check_kv_cache(self.kv_cache)
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads={self.threads}: give at least 1.")
        unknown = [name for name in self.drafters or () if name not in DRAFTERS]
        if unknown:
            raise ConfigError(f"unknown drafters {', '.join(unknown)}: choose from {', '.join(DRAFTERS)}.")
        for method in self.cross_vocab_methods:
            SpecConfig(drafter="cross-vocab", draft_model="any", cross_vocab_method=method)  # validates the name
        if self.heads is not None:
            self._check_heads()

    def _check_heads(self) -> None:
        """--heads holds a head for each head drafter the run names (for every drafter, the
        default: for at least one), each a head of its kind: said now, not after the target has
        loaded and the other rows have run."""
        running = [name for name in HEAD_DRAFTERS if name in (self.drafters or DRAFTERS)]
        if not running:
            raise ConfigError(f"--heads {self.heads}: no head drafter runs; add eagle or medusa to --drafters, "
                              "or leave --heads out.")
        folder = Path(self.heads)
        found = [name for name in running if (folder / name).is_dir()]
        required = running if self.drafters else found or running
        missing = [name for name in required if name not in found]
        if missing:
            raise ConfigError(f"--heads {folder} has no {' or '.join(f'{name}/' for name in missing)}: give the "
                              "--out folder of `draftwise train` (it writes OUT/eagle and OUT/medusa), or leave "
                              "--heads out to use the heads shipped for --model.")
        for name in found:
            check_before_loading(SpecConfig(drafter=name, head=str(folder / name)), self.model)


def build_methods(config: BenchConfig, progress: bool = True) -> tuple[list[Method], list[str]]:
    """Every draftwise drafter in the registry, quantized draftwise rows, then the peers
    (transformers, llama.cpp). Returns the methods and notes on what was skipped and why."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    target = loading.load(config.model, dtype=config.dtype, auto_fetch=True, progress=progress,
                          activations=config.activations, kv_cache=config.kv_cache)
    skipped: list[str] = []
    methods = _draftwise_methods(target, config, "", list(config.drafters or DRAFTERS), skipped, progress)
    for activations in config.activation_rows:
        rounded = loading.load(config.model, dtype=config.dtype, progress=progress, activations=activations,
                               kv_cache=config.kv_cache)
        drafters = [name for name in ("ngram", "model", "eagle", "medusa") if name in (config.drafters or DRAFTERS)]
        methods += _draftwise_methods(rounded, config, f"{activations}-act ", drafters, skipped, progress)
    for quantize in config.quantize:
        quantized = loading.load(config.model, dtype="float32", quantize=quantize, progress=progress,
                                 kv_cache=config.kv_cache)
        methods += _draftwise_methods(quantized, config, f"{quantize} ", ["none", "ngram"], skipped, progress)
    if config.with_transformers:
        methods += _transformers_methods(target, methods[0].engine.encode, config, skipped, progress)
    if config.with_llama_cpp:
        methods += _llama_cpp_methods(target, methods[0].engine.encode, config, skipped)
    return methods, skipped


def _draftwise_methods(target: LoadedModel, config: BenchConfig, label: str, drafters: list[str],
                       skipped: list[str], progress: bool) -> list[Method]:
    """Plain decoding plus each named drafter on one target; label names the weight format."""
    plain = f"draftwise {label}plain"
    methods: list[Method] = [DraftwiseMethod(plain, Engine(target), reference=None)]
    for name in drafters:
        if DRAFTERS[name] is None:
            continue  # plain decoding is already first
        cross_vocab = name == "cross-vocab"
        for method in config.cross_vocab_methods if cross_vocab else ("auto",):
            try:  # a drafter that needs an option the user did not give is skipped, with the reason
                spec = SpecConfig(drafter=name, num_draft_tokens=config.num_draft_tokens,
                                  draft_model=config.cross_vocab_draft if cross_vocab else config.draft_model,
                                  draft_length=config.draft_length, cross_vocab_method=method,
                                  head=_head_folder(config.heads, name))
            except ConfigError as error:
                reason = "needs --cross-vocab-draft NAME" if cross_vocab else str(error)
                skipped.append(f"draftwise {label}{name}: {reason}")
                break
            try:
                drafter = build_drafter(spec, target, dtype=config.dtype, progress=progress)
            except ConfigError as error:  # e.g. no head shipped for this model
                skipped.append(f"draftwise {label}{name}: {error}")
                break
            k = spec.max_draft_tokens
            kind = f"{name} {drafter.method}" if cross_vocab else name
            title = f"draftwise {label}{kind} " + (f"k<={k} adaptive" if spec.draft_length == "adaptive" else f"k={k}")
            methods.append(DraftwiseMethod(title, engine_for(spec, target, drafter), reference=plain))
    return methods


def _head_folder(heads: str | None, drafter: str) -> str | None:
    """The head a head drafter reads from a `draftwise train` output folder (None: shipped)."""
    if heads is None or drafter not in HEAD_DRAFTERS:
        return None
    return str(Path(heads) / drafter)


def _transformers_methods(target: LoadedModel, encode, config: BenchConfig, skipped: list[str],
                          progress: bool) -> list[Method]:
    from transformers import AutoModelForCausalLM

    torch_dtype = loading.parse_dtype(config.transformers_dtype or config.dtype)
    hf_target = _in_own_memory(AutoModelForCausalLM.from_pretrained(loading.weights_folder(target, progress),
                                                                      dtype=torch_dtype).eval())
    eos = target.model.info.eos_token_ids
    methods: list[Method] = [
        TransformersMethod("transformers plain", hf_target, encode, eos),
        TransformersMethod(TRANSFORMERS_PROMPT_LOOKUP, hf_target, encode, eos,
                           prompt_lookup_num_tokens=config.prompt_lookup_num_tokens),
    ]
    if config.draft_model:
        draft_folder = loading.resolve(config.draft_model, progress=progress)
        hf_draft = _in_own_memory(AutoModelForCausalLM.from_pretrained(draft_folder, dtype=torch_dtype).eval())
        methods.append(TransformersMethod("transformers assisted", hf_target, encode, eos, assistant_model=hf_draft))
    else:
        skipped.append("transformers assisted: needs --draft-model")
    if config.cross_vocab_draft:
        # Universal assisted generation: transformers' own cross-tokenizer drafting.
        from transformers import AutoTokenizer

        draft_folder = loading.resolve(config.cross_vocab_draft, auto_fetch=True, progress=progress)
        hf_draft = _in_own_memory(AutoModelForCausalLM.from_pretrained(draft_folder, dtype=torch_dtype).eval())
        methods.append(TransformersMethod(TRANSFORMERS_UNIVERSAL_ASSISTED, hf_target, encode, eos, assistant_model=hf_draft,
                                          tokenizer=target.tokenizer,
                                          assistant_tokenizer=AutoTokenizer.from_pretrained(draft_folder)))
    else:
        skipped.append(f"{TRANSFORMERS_UNIVERSAL_ASSISTED}: needs --cross-vocab-draft")
    return methods


def _in_own_memory(model):
    """Copy a transformers model's weights out of the memory-mapped safetensors file. Left
    mapped (and not cache-line aligned), float32 Qwen2.5-1.5B decoded at 2.07 tok/s here
    instead of 3.59: a fair baseline is the faster one."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()
    return model


def _llama_cpp_methods(target: LoadedModel, encode, config: BenchConfig, skipped: list[str]) -> list[Method]:
    """llama.cpp plain and with its prompt-lookup draft, on the model's own GGUF file."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        skipped.append(f"llama.cpp: llama-cpp-python is not installed ({LLAMA_CPP_INSTALL})")
        return []
    gguf = _gguf_file(config.model)
    if gguf is None:
        skipped.append(f"llama.cpp: {config.model!r} has no GGUF file (give a packaged model or a .gguf path)")
        return []
    eos = target.model.info.eos_token_ids
    options = {"model_path": str(gguf), "n_ctx": target.model.info.max_context, "n_threads": torch.get_num_threads(),
               "n_batch": 512, "verbose": False}
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=config.prompt_lookup_num_tokens)
    return [
        LlamaCppMethod(LLAMA_CPP_PLAIN, Llama(**options), encode, eos, reference=None),
        LlamaCppMethod("llama.cpp prompt lookup", Llama(**options, draft_model=lookup), encode, eos,
                       reference=LLAMA_CPP_PLAIN),
    ]


def _gguf_file(spec: str) -> Path | None:
    if spec in registry.PACKAGED_MODELS:
        return registry.gguf_path(spec) if registry.is_fetched(spec) else None
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def run_bench(methods: list[Method], prompts: list[BenchPrompt], max_new_tokens: int, repeats: int,
              progress: bool = True, chat: bool = True) -> list[dict]:
    """One row per (prompt, method): median tokens/s over repeats, spread, speculation stats,
    and whether the output equals its reference's (plain greedy decoding on the same weights).
    A method's reference must come before it in methods. chat: give the methods each prompt's
    messages (else their text: a base model without a chat template)."""
    first = prompts[0].input(chat)
    for method in methods:  # warm-up: first calls allocate caches and pick kernels
        method.run(first, min(8, max_new_tokens))
    rows = []
    with tqdm(total=len(prompts) * len(methods) * repeats, desc="bench", unit="run", disable=not progress) as bar:
        for prompt in prompts:
            outputs: dict[str, list[int]] = {}
            for method in methods:  # interleaved per prompt, so machine drift hits all methods alike
                seconds, output = [], None
                for _ in range(repeats):
                    tic = time.perf_counter()
                    output = method.run(prompt.input(chat), max_new_tokens)
                    seconds.append(time.perf_counter() - tic)
                    bar.update()
                outputs[method.name] = output.token_ids
                reference = outputs.get(method.reference) if method.reference else None
                num_tokens = len(output.token_ids)
                rates = [num_tokens / s for s in seconds]
                rows.append({
                    "prompt": prompt.id, "category": prompt.category, "method": method.name,
                    "num_tokens": num_tokens, "seconds": statistics.median(seconds),
                    "tokens_per_second": statistics.median(rates), "tokens_per_second_min": min(rates),
                    "tokens_per_second_max": max(rates),
                    "reference": method.reference,
                    "same_as_reference": None if reference is None else output.token_ids == reference,
                    "metrics": output.metrics.to_dict() if output.metrics else None,
                })
    return rows
