"""The pure-torch emulation of TE's FP8 quantizers (`kernels/fp8_quant.py`) on cases
computed by hand from TE 2.12's kernels (recipe_common.cuh, delayed_scaling.cu,
quantize_transpose_{vector,square}_blockwise.cu)."""

import pytest
import torch

from megatron_overlap.kernels import fp8_quant as q

NAN = float("nan")


def test_scale_from_amax_follows_te_for_zero_infinite_tiny_and_floored_amax():
    amax = torch.tensor([0.0, float("inf"), NAN, 3.0, 1e-45, 0.5])
    plain = q.scale_from_amax(amax, 448.0)
    # 0, inf and NaN give 1; 448 / 3 in fp32; a scale past fp32's range gives FLT_MAX
    assert plain.tolist() == [1.0, 1.0, 1.0, torch.tensor(448 / 3).float().item(), q.FLT_MAX,
                              896.0]
    pow2 = q.scale_from_amax(amax, 448.0, pow2=True)  # mantissa cleared: 2^floor(log2)
    assert pow2.tolist() == [1.0, 1.0, 1.0, 128.0, 2.0 ** 127, 512.0]
    floored = q.scale_from_amax(torch.tensor([0.0, 0.25, 4.0]), 448.0, epsilon=1.0)
    assert floored.tolist() == [448.0, 448.0, 112.0]  # amax < epsilon counts as epsilon


def test_tensorwise_current_scaling_maps_the_amax_to_448_and_saturates():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    data, scale_inv = q.quantize_tensorwise(x)
    assert data.dtype == torch.float8_e4m3fn and scale_inv.shape == ()
    assert data.float().tolist() == [[112.0, -224.0], [56.0, 448.0]]  # scale 448 / 4 = 112
    assert scale_inv.item() == torch.tensor(1 / 112).float().item()
    data, scale_inv = q.quantize_tensorwise(x, pow2=True)  # scale 64
    assert data.float().tolist() == [[64.0, -128.0], [32.0, 256.0]] and scale_inv.item() == 1 / 64
    data, _ = q.quantize_with_scale(torch.tensor([1000.0, -1e30, 0.3]), torch.tensor(1.0))
    assert data.float().tolist() == [448.0, -448.0, 0.3125]  # saturated; e4m3 nearest of 0.3
    data, scale_inv = q.quantize_tensorwise(torch.zeros(3))
    assert scale_inv.item() == 1.0 and not data.float().any()


def test_tensorwise_splits_give_each_expert_its_own_scale_and_one_to_an_empty_one():
    x = torch.tensor([[2.0], [-7.0], [0.5]])
    data, scale_inv = q.quantize_tensorwise_splits(x, [2, 0, 1])
    # amax 7 -> scale 64; amax 0.5 -> 896 (scale_inv 1 / 896 in fp32)
    assert scale_inv.tolist() == [1 / 64, 1.0, torch.tensor(1 / 896).float().item()]
    assert data.float().flatten().tolist() == [128.0, -448.0, 448.0]


def test_delayed_scaling_update_takes_the_history_max_or_latest_with_margin_and_rolls():
    history = torch.tensor([2.0, 8.0, 4.0])  # row 0: the amax recorded this step
    rolled, scale = q.delayed_scale_update(history, torch.tensor(1.0))
    assert scale.item() == 56.0 and rolled.tolist() == [0.0, 4.0, 2.0]  # 448 / 8
    _, scale = q.delayed_scale_update(history, torch.tensor(1.0), algo="most_recent")
    assert scale.item() == 224.0
    _, scale = q.delayed_scale_update(history, torch.tensor(1.0), margin=1)
    assert scale.item() == 28.0
    _, scale = q.delayed_scale_update(torch.zeros(3), torch.tensor(5.0))
    assert scale.item() == 5.0  # no amax seen: the scale stays
    per_tensor = torch.tensor([[1.0, 0.0], [7.0, 0.0]])  # [L, n]: two tensors' histories
    rolled, scale = q.delayed_scale_update(per_tensor, torch.tensor([1.0, 3.0]))
    assert scale.tolist() == [64.0, 3.0] and rolled.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="algo"):
        q.delayed_scale_update(history, torch.tensor(1.0), algo="mean")


def test_1x128_blocks_scale_each_row_and_k_block_in_tes_transposed_padded_layout():
    x = torch.zeros(2, 256)
    x[0, 5], x[0, 200], x[1, 130] = 3.0, -0.25, 1.0  # row 1's first block stays zero
    data, scale_inv = q.quantize_blockwise(x, 1)
    # [ceil(K/128), roundup(M, 4)] = [2, 4], element [kb, m]: scales 128, 1024, 1, 256
    assert scale_inv.shape == (2, 4) and scale_inv[:, 2:].isnan().all()
    assert scale_inv[:, :2].tolist() == [[1 / 128, 1.0], [1 / 1024, 1 / 256]]
    assert (data[0, 5].item(), data[0, 200].item(), data[1, 130].item()) == (384.0, -256.0, 256.0)
    assert torch.equal(q.dequantize_blockwise(data, scale_inv, 1), x.double())


def test_128x128_blocks_scale_each_tile_in_tes_padded_layout():
    w = torch.zeros(130, 200)
    w[0, 0], w[127, 199], w[128, 0], w[129, 128] = 7.0, 1.5, 0.0625, -100.0
    data, scale_inv = q.quantize_blockwise(w, 128, pow2=False)
    # [ceil(N/128), roundup(ceil(K/128), 4)] = [2, 4], element [nb, kb]; fp32 scales
    assert scale_inv.shape == (2, 4) and scale_inv[:, 2:].isnan().all()
    want = torch.tensor([[448 / 7, 448 / 1.5], [448 / 0.0625, 448 / 100]]).float()
    assert torch.equal(scale_inv[:, :2], 1.0 / want)
    assert data[129, 128].item() == -448.0 and data[0, 0].item() == 448.0


def test_blockwise_scale_past_fp32_range_takes_the_input_types_largest_value():
    """A block's amax so small that 448 / amax overflows: TE uses the input type's max
    finite value (bf16's here), then the power-of-2 rounding if asked."""
    x = torch.full((1, 128), 1e-40).bfloat16()
    _, plain = q.quantize_blockwise(x, 1, pow2=False)
    assert plain[0, 0].item() == (1.0 / torch.tensor(torch.finfo(torch.bfloat16).max).double()
                                  ).float().item()
    _, pow2 = q.quantize_blockwise(x, 1)
    assert pow2[0, 0].item() == 2.0 ** -127


def test_blockwise_round_trip_is_within_e4m3_rounding_of_each_blocks_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * 2.0 ** torch.randint(-8, 8, (37, 1), generator=g)
    for rows in (1, 128):
        data, scale_inv = q.quantize_blockwise(x, rows)
        back = q.dequantize_blockwise(data, scale_inv, rows)
        # relative 2^-4 for normals; below e4m3's smallest normal 2^-6, 2^-10 of a scale_inv
        per_elem = (scale_inv[:, :37].t() if rows == 1 else scale_inv[:, :3]).double()
        per_elem = per_elem.repeat_interleave(rows, 0)[:37].repeat_interleave(128, 1)[:, :300]
        assert ((back - x.double()).abs() <= 2.0 ** -4 * x.double().abs()
                + 2.0 ** -10 * per_elem).all()
    with pytest.raises(ValueError, match="block_rows"):
        q.quantize_blockwise(x, 64)
