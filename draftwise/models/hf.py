"""Any transformers causal LM behind the CausalLM interface: the fallback for architectures the
native decoder (models/llama.py) does not implement (e.g. Phi-3, Gemma 2).

It is slower than the native decoder (transformers' own forward, a growing DynamicCache), so
it suits draft models and experiments more than big targets. Rolling back crops the cache. Not
batch-invariant: transformers' products may round a row differently by how many rows share a
forward, so speculation here equals plain decoding up to near-ties, not bit for bit.
"""

from __future__ import annotations

import inspect

import torch

from draftwise.errors import ModelLoadError
from draftwise.kv_cache import CacheLength
from draftwise.models.base import ModelInfo, Segment, forward_each


class HFCache(CacheLength):
    """A transformers DynamicCache behind draftwise's cache bookkeeping; rollback crops it."""

    def __init__(self, max_length: int) -> None:
        from transformers import DynamicCache

        super().__init__(max_length)
        # No config: every layer keeps all its keys and values, sliding-window layers included
        # (their window is applied by the attention mask), so any length can be cropped back.
        self.inner = DynamicCache()

    def _forget(self, num_tokens: int) -> None:
        self.inner.crop(-num_tokens)  # transformers 5: a negative count of tokens to remove


class HFModel:
    """A transformers AutoModelForCausalLM, scoring tokens as draftwise's models do."""

    def __init__(self, model, info: ModelInfo) -> None:
        self.model = model.eval()
        self.info = info
        # The cache's keyword: `cache` in recent transformers 5 releases (which warn that
        # `past_key_values` goes in 5.40), `past_key_values` in the earlier ones pyproject allows.
        self.cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, max_length: int) -> HFCache:
        return HFCache(max_length)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: HFCache,
        attn_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        hidden_layers: tuple[int, ...] = (),  # see CausalLM.forward
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [num_logits or T, vocab] float32 (, hidden)
        if attn_mask is not None or hidden_layers:
            raise ModelLoadError(
                f"{self.info.name} runs through the transformers fallback, which cannot verify draft "
                "trees nor feed heads its hidden states: use a chain drafter (ngram, model, cross-vocab)."
            )
        start = cache.reserve(tokens.shape[0])
        output = self.model(
            input_ids=tokens[None],
            position_ids=positions[None],
            cache_position=torch.arange(start, start + tokens.shape[0]),
            use_cache=True,
            **{self.cache_keyword: cache.inner},
            logits_to_keep=num_logits or 0,  # 0: all
        )
        return output.logits[0].float()


    def forward_batch(self, segments: list[Segment], hidden_layers: tuple[int, ...] = ()) -> list:
        return forward_each(self, segments, hidden_layers)  # one transformers forward per sequence


def load_hf_model(folder, info: ModelInfo, dtype: torch.dtype) -> HFModel:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as error:  # transformers raises many types for checkpoints it cannot read
        raise ModelLoadError(f"transformers could not load {info.name} from {folder}: {error}") from error
    return HFModel(model, info)
