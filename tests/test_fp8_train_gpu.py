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


@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("counts", [[33, 0, 70, 25, 1, 0, 47, 16], [128] * 8, [0] * 7 + [300]])
def test_fp8_dgrad_and_wgrad_are_the_float64_products_of_their_fp8_operands(counts, grad_dtype):
    """e4m3 gradients on torch's scaled grouped GEMM; e5m2 (hybrid) too, carried in e4m3
    (its products e5m2's)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch's scaled grouped GEMM path is sm90's")
    from megatron_overlap.ops import (Fp8Rows, Fp8Stack, GradFp8, fp8_expert_linear,
                                      quantize_fp8_groups, quantize_fp8_stack)

    g = torch.Generator(device="cuda").manual_seed(8)
    rows, experts, n, k = sum(counts) + 9, len(counts), 256, 512  # (9 padding rows)
    x = (torch.randn(rows, k, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    params = [(torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
              .requires_grad_(True) for _ in range(experts)]
    ends = torch.tensor(counts, device="cuda").cumsum(0)
    weight = Fp8Stack(*quantize_fp8_stack(torch.stack([p.detach() for p in params])))
    y = fp8_expert_linear(x, ends, weight, params, grad=GradFp8(grad_dtype))
    dy = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    y.backward(dy)
    dq = Fp8Rows(*quantize_fp8_groups(dy, ends, dtype=grad_dtype))
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


def test_e5m2_carried_in_e4m3_on_the_gpu_is_the_interpreters_cast():
    """Hybrid's gradients carried in e4m3 (current and delayed scales, one stale enough
    to leave e5m2's top unused), compiled for the GPU, against the pure-torch reference."""
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator(device="cuda").manual_seed(10)
    x = (torch.randn(900, 256, device="cuda", generator=g)
         * torch.logspace(-9, 3, 900, device="cuda")[:, None]).bfloat16()
    counts = [300, 0, 450, 100]
    ends = torch.tensor(counts, device="cuda").cumsum(0)
    for scale in (None, torch.tensor([1.0, 1.0, 3e3, 2e-2], device="cuda")):
        kw = [{} if scale is None else dict(scale=scale.clone(),
                                            amax_into=torch.zeros(4, device="cuda"))
              for _ in range(2)]
        got = quantize_groups(x, ends, dtype=torch.float8_e5m2,
                              carrier=torch.float8_e4m3fn, **kw[0])
        want = quantize_groups_reference(x, counts, dtype=torch.float8_e5m2,
                                         carrier=torch.float8_e4m3fn, **kw[1])
        assert torch.equal(got[0].float(), want[0].float())
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_blockwise_kernels_on_the_gpu_are_tes_quantizer_exactly(fmt):
    """The blockwise recipe's rows (1x128), each expert's columns (128x1 from its first
    row) and 128x128 weight blocks, compiled for the GPU, against TE's quantizer emulated:
    values over 10 decades (the columns' subnormals), an empty expert, a partial block."""
    from megatron_overlap.kernels.fp8_blocks import (
        fake_quantize_columns, fake_quantize_columns_reference, fake_quantize_rows,
        fake_quantize_rows_reference, fake_quantize_weights, fake_quantize_weights_reference)

    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(1000, 640, device="cuda", generator=g)
         * torch.logspace(-7, 3, 1000, device="cuda")[:, None]).bfloat16()
    ends = [0, 333, 333, 900, 990]
    assert torch.equal(fake_quantize_rows(x, fmt), fake_quantize_rows_reference(x, fmt))
    cols = fake_quantize_columns(x, torch.tensor(ends, device="cuda", dtype=torch.int32), fmt)
    assert torch.equal(cols[:990], fake_quantize_columns_reference(x, ends, fmt)[:990])
    w = torch.randn(3, 300, 640, device="cuda", generator=g).bfloat16()
    assert torch.equal(fake_quantize_weights(w), fake_quantize_weights_reference(w))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_delayed_quantization_on_the_gpu_is_tes_float8_quantizer(dtype):
    """Delayed scaling's grouped cast, compiled for the GPU: each group cast with its given
    scale from strided views of a TE-like scale and amax history (saturating where the
    stale scale overflows), the amax folded in by max, against the per-group emulation
    of TE's Float8Quantizer."""
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator(device="cuda").manual_seed(10)
    x = (torch.randn(1000, 640, device="cuda", generator=g)
         * torch.logspace(-4, 3, 1000, device="cuda")[:, None]).bfloat16()
    counts = [333, 0, 567, 90]  # (10 padding rows)
    ends = torch.tensor(counts, device="cuda").cumsum(0)
    scale = torch.rand(12, device="cuda", generator=g) * 4
    history = torch.rand(2, 12, device="cuda", generator=g) * 100
    want_history = history.clone()
    data, group_si, row_si = quantize_groups(x, ends, None, dtype, scale[1::3], history[0][1::3])
    ref = quantize_groups_reference(x, counts, None, dtype, scale[1::3], want_history[0][1::3])
    assert torch.equal(data.float(), ref[0].float())
    assert torch.equal(group_si, ref[1]) and torch.equal(row_si, ref[2])
    assert torch.equal(history, want_history)
