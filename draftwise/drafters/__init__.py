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


def _build_history(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    from draftwise.config import DEFAULT_HISTORY_TOKENS
    from draftwise.drafters.history import HistoryDrafter, NgramHistory, tokenizer_id

    capacity = DEFAULT_HISTORY_TOKENS if spec.history_tokens is None else spec.history_tokens
    history = NgramHistory(spec.ngram_max, capacity, spec.history_file, tokenizer_id(target.tokenizer))
    return HistoryDrafter(history, spec.ngram_min, spec.ngram_max)


def _check_history_file(spec: SpecConfig, model: str) -> None:
    """The history file can be written where it was asked for (its folder exists)."""
    from pathlib import Path

    if spec.history_file is not None and not Path(spec.history_file).resolve().parent.is_dir():
        raise ConfigError(f"--history-file {spec.history_file}: the folder {Path(spec.history_file).resolve().parent} "
                          "does not exist; create it first.")


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


def _build_eagle(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    from draftwise.drafters.eagle import EagleDrafter
    from draftwise.heads import head_for
    from draftwise.heads.eagle import load_head

    _check_native(target)
    return EagleDrafter(load_head(spec.head or head_for(target.model.info.name, "eagle", target.model.shape), target.model), target.model)


def _build_medusa(spec: SpecConfig, target: LoadedModel, dtype: str, progress: bool) -> Drafter:
    from draftwise.drafters.medusa import MedusaDrafter
    from draftwise.heads import head_for
    from draftwise.heads.medusa import load_medusa

    _check_native(target)
    return MedusaDrafter(load_medusa(spec.head or head_for(target.model.info.name, "medusa", target.model.shape), target.model), target.model)


def _check_native(target: LoadedModel) -> None:
    if not hasattr(target.model, "shape"):
        raise ConfigError(f"{target.model.info.name} runs through the transformers fallback, which cannot feed a "
                          "head its hidden states: use --drafter ngram, model or cross-vocab.")


def _check_head(kind: str) -> Callable[[SpecConfig, str], None]:
    """The check of a head drafter's head before the target loads: the --head folder is a head of
    this kind, or one is shipped for a packaged target (a hub id or path is checked after loading,
    against the loaded model's name)."""
    def check(spec: SpecConfig, model: str) -> None:
        import importlib

        from draftwise.heads import head_for
        from draftwise.heads.eagle import read_head_config
        from draftwise.models.registry import PACKAGED_MODELS

        if spec.head is not None:  # heads/eagle.py or heads/medusa.py says which format it reads
            read_head_config(spec.head, kind, importlib.import_module(f"draftwise.heads.{kind}").FORMAT_VERSION)
        elif model in PACKAGED_MODELS:
            head_for(model, kind)
    return check


def _check_draft_model(spec: SpecConfig, model: str) -> None:
    """The draft model can be found (packaged and fetched, a folder or .gguf, or a hub id)."""
    from draftwise.models import loading

    loading.check_findable(spec.draft_model)


# name -> check(spec, model), what can be refused before any model loads (seconds to minutes).
CHECKS_BEFORE_LOADING: dict[str, Callable[[SpecConfig, str], None]] = {
    "model": _check_draft_model,
    "cross-vocab": _check_draft_model,
    "eagle": _check_head("eagle"),
    "medusa": _check_head("medusa"),
    "history": _check_history_file,
}


def check_before_loading(spec: SpecConfig, model: str) -> None:
    """Refuse, before the target loads, what the drafter's factory would refuse after it."""
    _factory(spec.drafter)
    check = CHECKS_BEFORE_LOADING.get(spec.drafter)
    if check is not None:
        check(spec, model)


# name -> factory(spec, target, dtype, progress); None means plain decoding.
DRAFTERS: dict[str, Callable[[SpecConfig, LoadedModel, str, bool], Drafter] | None] = {
    "none": None,
    "ngram": _build_ngram,
    "model": _build_model,
    "cross-vocab": _build_cross_vocab,
    "eagle": _build_eagle,
    "medusa": _build_medusa,
    "history": _build_history,
}


def _factory(name: str) -> Callable[[SpecConfig, LoadedModel, str, bool], Drafter] | None:
    try:
        return DRAFTERS[name]
    except KeyError:
        raise ConfigError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}.") from None


def build_drafter(spec: SpecConfig, target: LoadedModel, dtype: str = "auto", progress: bool = True) -> Drafter | None:
    factory = _factory(spec.drafter)
    return None if factory is None else factory(spec, target, dtype, progress)


__all__ = ["DRAFTERS", "CrossVocabDrafter", "Draft", "Drafter", "ModelDrafter", "NgramDrafter", "build_drafter",
           "check_before_loading"]
