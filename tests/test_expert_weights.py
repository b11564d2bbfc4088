"""ops.ExpertWeightStack and with_bias_columns: the FC2 operands the layer hands the op."""

import pytest
import torch

from megatron_overlap.ops import BIAS_COLUMNS, ExpertWeightStack, with_bias_columns


def _weights(e=3, n=4, k=8, packed=False):
    g = torch.Generator().manual_seed(0)
    if packed:
        base = torch.randn(e, n, k, generator=g)
        return [torch.nn.Parameter(base[i]) for i in range(e)]  # (views of one storage)
    return [torch.nn.Parameter(torch.randn(n, k, generator=g)) for _ in range(e)]


def test_back_to_back_weights_are_read_as_a_view_and_others_are_stacked_once():
    packed = _weights(packed=True)
    stack = ExpertWeightStack()
    w = stack.operand(packed)
    assert w.untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr()
    loose, stack = _weights(), ExpertWeightStack()
    first = stack.operand(loose)
    assert torch.equal(first, torch.stack([p.detach() for p in loose]))
    assert stack.operand(loose).data_ptr() == first.data_ptr()  # cached: no new copy


def test_a_changed_weight_rebuilds_the_stack():
    loose, stack = _weights(), ExpertWeightStack()
    stack.operand(loose)
    with torch.no_grad():
        loose[1].add_(1.0)
    assert torch.equal(stack.operand(loose)[1], loose[1].detach())


def test_gradients_reach_every_weight_and_bias():
    loose = _weights()
    biases = [torch.nn.Parameter(torch.randn(4)) for _ in loose]
    w = ExpertWeightStack().operand(loose, biases)
    assert w.shape == (3, 4, 8 + BIAS_COLUMNS)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    scale = torch.rand(5, generator=g)
    xb = with_bias_columns(x, scale)
    (xb @ w[1].t()).sum().backward()
    # The float64 sums are the reference; BLAS may add the five rows in any order, so an
    # element near zero after cancellation is held to an absolute float32 tolerance.
    x_sum = x.detach().double().sum(0).float()
    torch.testing.assert_close(loose[1].grad, x_sum.expand(4, 8), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(biases[1].grad, scale.double().sum().float().expand(4), rtol=1e-5, atol=1e-6)
    assert loose[0].grad is None or not loose[0].grad.any()


def test_bad_operands_are_clear_errors():
    stack = ExpertWeightStack()
    with pytest.raises(ValueError, match="weights must be"):
        stack.operand([])
    with pytest.raises(ValueError, match="weights must be"):
        stack.operand([torch.zeros(2, 3, 4)])  # a list of 3-D tensors
    with pytest.raises(ValueError, match="biases must be"):
        stack.operand(_weights(), [torch.zeros(4), torch.zeros(5), torch.zeros(4)])
    with pytest.raises(ValueError, match="biases must be"):
        stack.operand(torch.zeros(3, 4, 8), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="bias_scale must be"):
        with_bias_columns(torch.zeros(5, 8), torch.zeros(4))
