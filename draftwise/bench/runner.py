"""Builds the methods to compare and times them on a prompt suite, side by side in one process."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from draftwise.bench.methods import DraftwiseMethod, Method, TransformersMethod
from draftwise.bench.suite import BenchPrompt
from draftwise.config import SpecConfig
from draftwise.drafters import DRAFTERS, build_drafter
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.models import loading

PLAIN = "draftwise plain"  # the reference every method's output is compared with


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "smollm2-135m"
    draft_model: str | None = None
    dtype: str = "float32"
    num_draft_tokens: int = 5
    prompt_lookup_num_tokens: int = 10  # transformers' prompt lookup, as its docs suggest
    max_new_tokens: int = 128
    repeats: int = 3
    with_transformers: bool = True

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"repeats={self.repeats}, max_new_tokens={self.max_new_tokens}: both must be at least 1.")


def build_methods(config: BenchConfig, progress: bool = True) -> tuple[list[Method], list[str]]:
    """Every draftwise drafter in the registry, then the transformers baselines. Returns the
    methods and notes on what was skipped and why."""
    target = loading.load(config.model, dtype=config.dtype, auto_fetch=True, progress=progress)
    methods: list[Method] = [DraftwiseMethod(PLAIN, Engine(target))]
    skipped: list[str] = []
    k = config.num_draft_tokens
    for name, factory in DRAFTERS.items():
        if factory is None:
            continue  # plain decoding is already first
        try:  # a drafter that needs an option the user did not give is skipped, with the reason
            spec = SpecConfig(drafter=name, num_draft_tokens=k, draft_model=config.draft_model)
        except ConfigError as error:
            skipped.append(f"draftwise {name}: {error}")
            continue
        drafter = build_drafter(spec, target, dtype=config.dtype, progress=progress)
        methods.append(DraftwiseMethod(f"draftwise {name} k={k}", Engine(target, drafter, k)))
    if not config.with_transformers:
        return methods, skipped
    from transformers import AutoModelForCausalLM

    torch_dtype = loading.parse_dtype(config.dtype)
    hf_target = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch_dtype).eval()
    encode = methods[0].engine.encode
    eos = target.model.info.eos_token_ids
    methods.append(TransformersMethod("transformers plain", hf_target, encode, eos))
    methods.append(TransformersMethod(f"transformers prompt lookup {config.prompt_lookup_num_tokens}", hf_target,
                                      encode, eos, prompt_lookup_num_tokens=config.prompt_lookup_num_tokens))
    if config.draft_model:
        draft_folder = loading.resolve(config.draft_model, progress=progress)
        hf_draft = AutoModelForCausalLM.from_pretrained(draft_folder, dtype=torch_dtype).eval()
        methods.append(TransformersMethod("transformers assisted", hf_target, encode, eos, assistant_model=hf_draft))
    else:
        skipped.append("transformers assisted: needs --draft-model")
    skipped.append("llama.cpp: not wired in yet (llama-cpp-python is an optional extra; see the README)")
    return methods, skipped


def run_bench(methods: list[Method], prompts: list[BenchPrompt], max_new_tokens: int, repeats: int,
              progress: bool = True) -> list[dict]:
    """One row per (prompt, method): median tokens/s over repeats, spread, speculation stats,
    and whether the output equals draftwise's plain greedy output."""
    first = list(prompts[0].messages)
    for method in methods:  # warm-up: first calls allocate caches and pick kernels
        method.run(first, min(8, max_new_tokens))
    rows = []
    with tqdm(total=len(prompts) * len(methods) * repeats, desc="bench", unit="run", disable=not progress) as bar:
        for prompt in prompts:
            reference = None
            for method in methods:  # interleaved per prompt, so machine drift hits all methods alike
                seconds, output = [], None
                for _ in range(repeats):
                    tic = time.perf_counter()
                    output = method.run(list(prompt.messages), max_new_tokens)
                    seconds.append(time.perf_counter() - tic)
                    bar.update()
                if method.name == PLAIN:
                    reference = output.token_ids
                num_tokens = len(output.token_ids)
                rates = [num_tokens / s for s in seconds]
                rows.append({
                    "prompt": prompt.id, "category": prompt.category, "method": method.name,
                    "num_tokens": num_tokens, "seconds": statistics.median(seconds),
                    "tokens_per_second": statistics.median(rates), "tokens_per_second_min": min(rates),
                    "tokens_per_second_max": max(rates),
                    "same_as_plain": None if reference is None else output.token_ids == reference,
                    "metrics": output.metrics.to_dict() if output.metrics else None,
                })
    return rows
