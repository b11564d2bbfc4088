"""The grouped FP8 experts' backward on torch's scaled grouped GEMM (sm90), on one GPU:
`pytest -m gpu tests/test_fp8_train_gpu.py`.

fp8_expert_linear's dgrad (2d x 3d) and wgrad (2d x 2d over 16-aligned group columns)
against the float64 products of the same e4m3 operands, at group sizes that are not
multiples of 16, with empty groups and padding rows (the wgrad's GEMM raises on an
unaligned group start: the column layout is what makes it run). Skipped off sm90.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")]


def _dequantized(rows):
    return rows.data.double() * rows.row_scale_inv.double()[:, None]


@pytest.mark.parametrize("counts", [[33, 0, 70, 25, 1, 0, 47, 16], [128] * 8, [0] * 7 + [300]])
def test_fp8_dgrad_and_wgrad_are_the_float64_products_of_their_fp8_operands(counts):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch's scaled grouped GEMM path is sm90's")
    from megatron_overlap.ops import (Fp8Rows, Fp8Stack, fp8_expert_linear,
                                      quantize_fp8_groups, quantize_fp8_stack)

    g = torch.Generator(device="cuda").manual_seed(8)
    rows, experts, n, k = sum(counts) + 9, len(counts), 256, 512  # (9 padding rows)
    x = (torch.randn(rows, k, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    params = [(torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
              .requires_grad_(True) for _ in range(experts)]
    ends = torch.tensor(counts, device="cuda").cumsum(0)
    weight = Fp8Stack(*quantize_fp8_stack(torch.stack([p.detach() for p in params])))
    y = fp8_expert_linear(x, ends, weight, params)
    dy = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    y.backward(dy)
    dq = Fp8Rows(*quantize_fp8_groups(dy, ends))
    xq = Fp8Rows(*quantize_fp8_groups(x.detach(), ends))
    valid = sum(counts)
    expert = torch.repeat_interleave(torch.arange(experts, device="cuda"),
                                     torch.tensor(counts, device="cuda"))
    w = weight.data.double() * weight.scale_inv.double()[:, None, None]
    want_dx = torch.einsum("rn,rnk->rk", _dequantized(dq)[:valid], w[expert])
    err = (x.grad[:valid].double() - want_dx).abs().max() / want_dx.abs().max()
    assert err < 2 ** -6, err  # (bf16 output; fast FP8 accumulation over 256)
    assert (x.grad[valid:] == 0).all()
    for e, p in enumerate(params):
        sel = expert == e
        want = _dequantized(dq)[:valid][sel].t() @ _dequantized(xq)[:valid][sel]
        if not sel.any():
            assert (p.grad == 0).all(), e
            continue
        err = (p.grad.double() - want).abs().max() / want.abs().max()
        assert err < 2 ** -6, (e, err)
