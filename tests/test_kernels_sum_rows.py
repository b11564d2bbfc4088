"""The permutation's atomic-free backward (`kernels/sum_rows.py`, `ops.permute_rows`)
against torch, under the interpreter."""

import pytest
import torch

from megatron_overlap import ops
from megatron_overlap.kernels import sum_rows

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests")


def uneven_routing(tokens: int, topk: int, seed: int) -> torch.Tensor:
    """[R] int64: each token's rows 0..topk of them (some none, some topk), shuffled, so
    a token's rows are neither adjacent nor sorted."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, topk + 1, (tokens,), generator=g)
    counts[::5] = 0
    counts[1::7] = topk
    index = torch.repeat_interleave(torch.arange(tokens), counts)
    return index[torch.randperm(index.numel(), generator=g)]


def _poisoned_empty(monkeypatch):
    """torch.empty as the wrapper sees it, filled with NaN: an element the kernel leaves
    unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(sum_rows.torch, "empty", poisoned)


@pytest.mark.parametrize("h", [96, 200])
@pytest.mark.parametrize("topk", [1, 6, 8])
def test_sum_rows_is_the_fp64_sum_within_one_bf16_rounding_and_zero_without_rows(
        monkeypatch, h, topk):
    tokens = 70
    index = uneven_routing(tokens, topk, seed=h + topk)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(index.numel(), h, generator=g).bfloat16()
    want = sum_rows.sum_rows_by_index_reference(rows, index, tokens)
    _poisoned_empty(monkeypatch)
    got = sum_rows.sum_rows_by_index(rows, index, tokens)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, h)
    assert not got.isnan().any()
    # one rounding of the fp32 sum: a bf16 ulp of the value, plus the fp32 sum's own error
    tol = want.abs() * 2.0 ** -7 + 1e-5 * topk
    assert ((got.double() - want).abs() <= tol).all()
    empty = torch.bincount(index, minlength=tokens) == 0
    assert empty.any() and (got[empty] == 0).all()
    assert torch.equal(got, sum_rows.sum_rows_by_index(rows, index, tokens))


def test_fp32_sum_runs_in_ascending_row_order_bit_for_bit():
    """The kernel adds a token's rows in r order, as CPU `index_add_` does one row after
    another; fp32 in and out, no rounding after the sum: the bits must agree."""
    index = uneven_routing(90, 8, seed=3)
    rows = torch.randn(index.numel(), 200, generator=torch.Generator().manual_seed(2)) * 1e3
    want = sum_rows.sum_rows_by_index_reference(rows, index, 90, dtype=torch.float32)
    got = sum_rows.sum_rows_by_index(rows, index, 90)
    assert torch.equal(got, want)
    reversed_order = torch.zeros_like(want).index_add_(0, index.flip(0), rows.flip(0))
    assert not torch.equal(got, reversed_order)  # the order is visible in these bits


def test_sum_rows_over_many_programs_with_a_full_column_block():
    """H = 2048: 512-column blocks, 2 tokens a program, 301 tokens over 151 x 4 programs
    (the last with one token)."""
    index = uneven_routing(301, 8, seed=4)
    rows = torch.randn(index.numel(), 2048, generator=torch.Generator().manual_seed(5))
    want = sum_rows.sum_rows_by_index_reference(rows, index, 301, dtype=torch.float32)
    assert sum_rows.block_shape(2048) == (2, 512)
    assert torch.equal(sum_rows.sum_rows_by_index(rows, index, 301), want)


def test_no_rows_gives_zeros_and_empty_shapes_are_fine():
    rows = torch.empty(0, 64, dtype=torch.bfloat16)
    got = sum_rows.sum_rows_by_index(rows, torch.empty(0, dtype=torch.int64), 5)
    assert got.shape == (5, 64) and (got == 0).all()
    assert sum_rows.sum_rows_by_index(torch.ones(3, 8), torch.zeros(3, dtype=torch.int64),
                                      0).shape == (0, 8)


@pytest.mark.parametrize("rows, index, num_src, match", [
    (torch.ones(4), torch.zeros(4, dtype=torch.int64), 2, r"rows must be \[R, H\]"),
    (torch.ones(4, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), 2, "fp32 sum"),
    (torch.ones(4, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.int64), 2, "fp32 sum"),
    (torch.ones(4, 8), torch.zeros(4, dtype=torch.int32), 2, "index must be int64"),
    (torch.ones(4, 8), torch.zeros(3, dtype=torch.int64), 2, r"R = 4"),
    (torch.ones(4, 8), torch.zeros(4, dtype=torch.int64), -1, "num_src must be"),
    (torch.ones(4, 8), torch.zeros(4, dtype=torch.int64), 2.0, "num_src must be"),
])
def test_sum_rows_names_the_bad_argument(rows, index, num_src, match):
    with pytest.raises(ValueError, match=match):
        sum_rows.sum_rows_by_index(rows, index, num_src)


def test_permute_rows_forward_is_index_selects_bits_and_its_gradient_the_fp64_one():
    index = uneven_routing(50, 8, seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50, 96, generator=g).bfloat16().requires_grad_(True)
    grad = torch.randn(index.numel(), 96, generator=g).bfloat16()
    out = ops.permute_rows(x, index)
    assert torch.equal(out, x.detach().index_select(0, index))
    out.backward(grad)
    x64 = x.detach().double().requires_grad_(True)
    x64.index_select(0, index).backward(grad.double())
    want = x64.grad
    assert x.grad.dtype == torch.bfloat16
    # (the interpreter rounds fp32 to bf16 toward zero, the GPU to nearest: one ulp)
    assert ((x.grad.double() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-4).all()


def test_permute_rows_gradient_keeps_trailing_dims():
    index = torch.tensor([2, 0, 2, 3])
    x = torch.randn(4, 3, 5, requires_grad=True)
    grad = torch.randn(4, 3, 5)
    ops.permute_rows(x, index).backward(grad)
    assert torch.equal(x.grad, torch.zeros_like(x).index_add_(0, index, grad))
    assert (x.grad[1] == 0).all()
    x.grad = None
    ops.permute_rows(x, index[:0]).backward(grad[:0])  # no rows (EP: none routed here)
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("dtype, interpreting", [(torch.float64, True),
                                                 (torch.float32, False)])
def test_permute_rows_gradient_is_torchs_for_fp64_and_off_the_kernels_devices(
        monkeypatch, dtype, interpreting):
    from megatron_overlap.ops import config

    monkeypatch.setattr(config, "interpreting", lambda: interpreting)
    called = []
    monkeypatch.setattr(sum_rows, "sum_rows_by_index", lambda *a: called.append(a))
    index = torch.tensor([2, 0, 2, 3])
    x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    grad = torch.randn(4, 8, dtype=dtype)
    ops.permute_rows(x, index).backward(grad)
    assert not called
    assert torch.equal(x.grad, torch.zeros_like(x).index_add_(0, index, grad))


def test_permute_rows_names_a_bad_argument():
    with pytest.raises(TypeError, match="permute_rows: index must be a torch.Tensor"):
        ops.permute_rows(torch.ones(2, 2), [0, 1])
    with pytest.raises(ValueError, match="permute_rows: index must be int64"):
        ops.permute_rows(torch.ones(2, 2), torch.tensor([0, 1], dtype=torch.int32))
