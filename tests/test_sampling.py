"""SamplingParams filters on hand-built logits, and validation of bad settings."""

import pytest
import torch

from draftwise.config import SamplingParams, SpecConfig
from draftwise.errors import ConfigError
from draftwise.sampling import logits_to_probs

LOGITS = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))


def test_temperature_one_keeps_the_distribution():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, LOGITS.exp(), atol=1e-6)


def test_greedy_is_a_point_mass_on_the_argmax():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.0))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_top_k_keeps_k_tokens_renormalised():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.40, 0.25, 0, 0, 0, 0]) / 0.65, atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    # 0.40 + 0.25 = 0.65 < 0.7, so 0.15 is needed too; 0.80 >= 0.7 so 0.10 is dropped.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]) / 0.80, atol=1e-6)


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))  # threshold 0.12
    assert torch.allclose(probs, torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]) / 0.80, atol=1e-6)


def test_low_temperature_sharpens():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = LOGITS.exp() ** 2
    assert torch.allclose(probs, expected / expected.sum(), atol=1e-6)


@pytest.mark.parametrize("temperature", [5e-324, 1e-30])  # the server's fuzzer sent 5e-324
def test_a_vanishing_temperature_is_the_argmax_not_nan(temperature):
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=temperature))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("top_p", [5e-324, 1e-30])  # the server's fuzzer sent 5e-324 (0 in float32)
def test_a_vanishing_top_p_keeps_the_most_likely_token_not_nan(top_p):
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -1}, "top_k=-1"),
        ({"min_p": 1.0}, "min_p=1.0"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_bad_sampling_params_are_refused_with_the_value_named(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_num_draft_tokens_below_one_is_refused():
    with pytest.raises(ConfigError, match="num_draft_tokens=0"):
        SpecConfig(num_draft_tokens=0)


def test_model_drafter_without_draft_model_is_refused():
    with pytest.raises(ConfigError, match="--draft-model"):
        SpecConfig(drafter="model")
