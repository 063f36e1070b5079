"""Drafter registry: the CLI and server pick drafters by name here, never in the core loop."""

from __future__ import annotations

from collections.abc import Callable

from draftwise.config import SpecConfig
from draftwise.drafters.base import Draft, Drafter
from draftwise.drafters.cross_vocab import CrossVocabDrafter
from draftwise.drafters.draft_model import ModelDrafter, check_same_vocabulary
from draftwise.drafters.ngram import NgramDrafter
from draftwise.errors import ConfigError
from draftwise.models.loading import LoadedModel


def _build_ngram(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    return NgramDrafter(spec.ngram_min, spec.ngram_max)


def _load_draft(spec: SpecConfig, dtype: str, progress: bool) -> LoadedModel:
    """The draft model, stored as spec.draft_quantize says ("auto": a GGUF draft's own blocks,
    another native draft in int8 blocks; the draft's numerics never reach the output)."""
    from draftwise.models import loading

    quantize = spec.draft_quantize
    if quantize == "auto":
        if not loading.runs_natively(spec.draft_model, progress=progress):
            quantize = "none"
        elif loading.gguf_source(spec.draft_model) is not None:
            return loading.load(spec.draft_model, dtype="auto", progress=progress)
        else:
            quantize = "int8"
    if quantize == "none":
        return loading.load(spec.draft_model, dtype=dtype, progress=progress)
    return loading.load(spec.draft_model, dtype="float32", progress=progress, quantize=quantize)


def _build_model(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    draft = _load_draft(spec, dtype, progress)
    check_same_vocabulary(target.tokenizer, draft.tokenizer, target.model.info.vocab_size, draft.model.info.vocab_size)
    return ModelDrafter(draft.model)


def _build_cross_vocab(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    draft = _load_draft(spec, dtype, progress)
    return CrossVocabDrafter(draft.model, draft.tokenizer, target.tokenizer, target.model.info.vocab_size,
                             spec.cross_vocab_method)


# name -> factory(spec, target, dtype, progress); None means plain decoding.
DRAFTERS: dict[str, Callable[[SpecConfig, LoadedModel, str, bool], Drafter] | None] = {
    "none": None,
    "ngram": _build_ngram,
    "model": _build_model,
    "cross-vocab": _build_cross_vocab,
}


def build_drafter(spec: SpecConfig, target: LoadedModel, dtype: str = "auto", progress: bool = True) -> Drafter | None:
    try:
        factory = DRAFTERS[spec.drafter]
    except KeyError:
        raise ConfigError(f"unknown drafter {spec.drafter!r}: choose one of {', '.join(DRAFTERS)}.") from None
    return None if factory is None else factory(spec, target, dtype, progress)


__all__ = ["DRAFTERS", "CrossVocabDrafter", "Draft", "Drafter", "ModelDrafter", "NgramDrafter", "build_drafter"]
