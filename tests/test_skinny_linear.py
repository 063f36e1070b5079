"""The float32 decode kernel (models/kernels/skinny_linear.cpp, models/skinny.py): it computes
x @ weight.T, each row of the result is bit-identical whatever the rows beside it, and a
machine that cannot build it still gets a working model and one warning naming the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from draftwise.models import skinny
from draftwise.models.linear import SKINNY_MAX_ROWS, SkinnyLinear, TransposedLinear, prepare_linears


@pytest.fixture(scope="module")
def kernel():
    built = skinny.skinny_kernel(progress=False)
    assert built is not None, "the kernel must build on this project's machines (g++ and ninja are there)"
    return built


# Shapes with every kind of tail: rows of the weight not a multiple of its 4-row blocks, input
# sizes not a multiple of the 16-wide vectors, and SmolLM2's real MLP shape.
SHAPES = [(37, 50), (4, 16), (3, 17), (1, 5), (1536, 576)]


@pytest.mark.parametrize("num_out, num_in", SHAPES)
def test_kernel_computes_the_matrix_product(kernel, num_out, num_in):
    torch.manual_seed(num_out * 7 + num_in)
    weight = torch.randn(num_out, num_in)
    for num_rows in (1, 2, 5, 6, 7, 11, 16):
        x = torch.randn(num_rows, num_in)
        reference = (x.double() @ weight.double().T).float()
        out = kernel(x, weight)
        assert out.shape == (num_rows, num_out)
        # float32 rounding over num_in terms, far below a wrong index or a lost tail (~1)
        assert torch.allclose(out, reference, rtol=1e-4, atol=1e-4 * num_in**0.5), (num_rows, num_in)


@pytest.mark.parametrize("num_out, num_in", SHAPES)
def test_each_row_is_bit_identical_whatever_rows_are_beside_it(kernel, num_out, num_in):
    # What makes a verify step's logits for a token those plain decoding would give it.
    torch.manual_seed(num_out + num_in)
    weight = torch.randn(num_out, num_in)
    x = torch.randn(16, num_in)
    together = kernel(x, weight)
    for start, num_rows in [(0, 1), (3, 1), (15, 1), (2, 5), (5, 6), (4, 7), (0, 11)]:
        alone = kernel(x[start:start + num_rows].contiguous(), weight)
        assert torch.equal(alone, together[start:start + num_rows]), (start, num_rows)


def test_kernel_rejects_what_it_cannot_multiply(kernel):
    with pytest.raises(RuntimeError, match="do not multiply"):
        kernel(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(torch.randn(2, 8).double(), torch.randn(4, 8).double())


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear_on_both_paths(kernel, bias):
    torch.manual_seed(3)
    linear = nn.Linear(576, 192, bias=bias)
    layer = SkinnyLinear(linear, kernel)
    for num_rows in (1, 4, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 40):  # the kernel, then MKL for a prefill
        x = torch.randn(num_rows, 576)
        assert torch.allclose(layer(x), linear(x), atol=1e-5), num_rows


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 16, bias=False))


def test_float32_models_get_the_kernel(kernel):
    model = prepare_linears(small_model(), torch.float32)
    assert isinstance(model[0], SkinnyLinear) and isinstance(model[2], SkinnyLinear)


def test_a_failed_build_warns_once_with_the_fix_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(skinny, "_BUILT", {})  # forget this process's build
    reference = small_model()
    x = torch.randn(3, 32)
    with pytest.warns(RuntimeWarning, match=r"c\+\+: command not found.*pip install ninja"):
        model = prepare_linears(small_model(), torch.float32, progress=False)
    assert isinstance(model[0], TransposedLinear)
    assert torch.allclose(model(x), reference(x), atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second model: no second warning
        prepare_linears(small_model(), torch.float32, progress=False)


def test_the_kernel_can_be_switched_off_without_a_warning(monkeypatch):
    monkeypatch.setenv(skinny.DISABLE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = prepare_linears(small_model(), torch.float32, progress=False)
    assert isinstance(model[0], TransposedLinear)
