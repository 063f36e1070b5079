"""Draft heads that read the target's hidden states, and the heads shipped with draftwise."""

from __future__ import annotations

from pathlib import Path

import torch

from draftwise.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent / "shipped"  # shipped/<target registry name>/<kind>/


def head_for(target_name: str, kind: str, shape=None) -> Path:
    """The head of this kind shipped for a packaged target, or a clear error saying how to train one.
    shape: the loaded target's DecoderShape, where there is one; a shipped head of this kind that
    fits it (a packaged model's own file in another quantization, or a copy under another name)
    is then named in the error, to pass with --head."""
    folder = SHIPPED / target_name / kind
    if not (folder / "head.json").is_file():
        shipped = sorted(f"{p.parent.name}/{p.name}" for p in SHIPPED.glob("*/*") if p.is_dir()) if SHIPPED.is_dir() else []
        message = (f"no {kind} head is shipped for {target_name} (shipped: {', '.join(shipped) or 'none'}): "
                   f"train one with `draftwise train --kind {kind} --target {target_name} --out DIR` "
                   f"and pass --head DIR/{kind}.")
        fitting = None if shape is None else _shipped_head_fitting(kind, shape)
        if fitting is not None:
            name, path = fitting
            message += (f" The shipped {kind} head for {name} fits this model's shape (hidden size "
                        f"{shape.hidden_size}, vocabulary {shape.vocab_size}): if this is {name} in another "
                        f"quantization or under another name, pass --head {path}. A head for another model of "
                        "the same shape drafts worse but never changes the output.")
        raise ConfigError(message)
    return folder


def _shipped_head_fitting(kind: str, shape) -> tuple[str, Path] | None:
    """(target name, folder) of the first shipped head of this kind that check_target would accept."""
    import json

    for config_path in sorted(SHIPPED.glob(f"*/{kind}/head.json")):
        config = json.loads(config_path.read_text())
        if _fits(config.get("hidden_size"), config.get("target_vocab_size"), config.get("hidden_layers") or [0], shape):
            return config_path.parent.parent.name, config_path.parent
    return None


def _fits(hidden_size: int, target_vocab_size: int, hidden_layers: list[int], shape) -> bool:
    """A head of these fields reads a target of this DecoderShape: its hidden size and vocabulary,
    and every layer it reads exists."""
    return hidden_size == shape.hidden_size and target_vocab_size == shape.vocab_size and \
        max(hidden_layers) <= shape.num_layers


def check_target(config, target_model) -> None:
    """Refuse a head trained for another target (its hidden size, vocabulary or layers differ)."""
    shape = target_model.shape
    if not _fits(config.hidden_size, config.target_vocab_size, config.hidden_layers, shape):
        raise ConfigError(
            f"the {config.kind} head was trained for {config.target!r} (hidden size {config.hidden_size}, vocabulary "
            f"{config.target_vocab_size}), not for {target_model.info.name} (hidden size {shape.hidden_size}, "
            f"vocabulary {shape.vocab_size}): train one with `draftwise train --kind {config.kind} "
            f"--target {target_model.info.name}`."
        )


def lm_head_rows(target_model, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's LM head as float32 [len(ids), hidden], whatever its weight format."""
    weight = target_model.lm_head.weight
    if hasattr(weight, "rows"):  # GGUF / quantized blocks
        return weight.rows(ids)
    return weight.detach()[ids].float()
