"""Logits -> probabilities under SamplingParams, and seeded sampling from them.

Coupled sampling (sampling_mode="coupled"): the token at position t is
argmax(log p_t + g_t), with g_t Gumbel noise over the vocabulary drawn from a generator keyed
by (seed, t) alone. Gumbel-max makes that an exact sample from p_t (after temperature and the
filters), independent across positions; and since the noise of a position never depends on
what was drafted, verification accepts a draft token exactly when it equals that token, and the
text is the same whatever the drafter, the draft lengths or the batch.
"""

from __future__ import annotations

import torch

from draftwise.config import SamplingParams
from draftwise.errors import ConfigError


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., vocab] into the distribution tokens are drawn from [..., vocab].

    Order, as in transformers and vLLM: temperature, then top-k, top-p and min-p filters, each
    of which zeroes tokens and leaves the rest to be renormalised. Greedy (temperature 0) is a
    point mass on the argmax, so the same verifier code serves both modes.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shifted so the largest logit is 0, and the temperature kept at least float32's smallest
    # normal (a Python float of 5e-324, which the server's fuzzer sent, is 0 in float32): a
    # vanishing temperature then gives 0 for the argmax and -inf for the rest, its limit,
    # instead of NaN. Above 1.2e-38 nothing changes but the rounding of the shift.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        # Keep a token if the mass strictly before it is below top_p: the smallest set whose
        # mass reaches top_p, always at least the most likely token.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        # The most likely token stays whatever top_p is: a Python float below float32's range
        # (5e-324, which the server's fuzzer sent) compares as 0, which would drop it too (NaN).
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_ids, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token id per row of probs [..., vocab] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby positions get unrelated generator seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [vocab] for output position `position`: a function of (seed, position)."""
    if seed is None:
        raise ConfigError("coupled sampling needs a seed: set SamplingParams.seed, or decode through an Engine "
                          "(it draws one per request when none is given), or use sampling_mode='rejection'.")
    generator = torch.Generator().manual_seed(_mix(seed, position))
    uniform = torch.rand(vocab_size, generator=generator).clamp_(min=1e-30)  # never log(0)
    return -torch.log(-torch.log(uniform))


def coupled_token(probs: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """The coupled choice from probs [vocab] for output position `position`: argmax(log probs +
    g) with that position's noise. The target samples its token this way (coupled_scores) and a
    drafter drafts with it, so the two agree wherever their distributions are close."""
    return (probs.log() + gumbel_noise(seed, position, probs.shape[-1])).argmax()


def coupled_scores(logits: torch.Tensor, params: SamplingParams, positions: list[int]) -> torch.Tensor:
    """Rows [n, vocab] whose argmax is the coupled sample of each row's position: log p + g.
    Filtered-out tokens score -inf, so they are never chosen."""
    log_probs = logits_to_probs(logits, params).log()
    noise = torch.stack([gumbel_noise(params.seed, position, logits.shape[-1]) for position in positions])
    return log_probs + noise


def make_generator(seed: int | None) -> torch.Generator:
    """A private CPU generator, so a seed reproduces a run regardless of other torch users."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
