"""GEMM2 kernels on a real GPU (device machine): `pytest -m gpu tests/test_kernels_gpu.py`.

The warp-specialized Gluon GEMM2 (`kernels/gemm2_ws.py`) has no interpreter path, so
this is where its output, its readiness counts and its agreement with the Triton kernel
are checked; `tools/compile_check.py` (CPU suite) checks that it compiles. The FP8
GEMM2's e4m3 wgmma (the interpreter's dot is exact) is checked here too.
"""

import pytest
import torch

from megatron_overlap.kernels import gemm2
from megatron_overlap.kernels.gemm2_places import token_places_reference
from routing_cases import fp8_reference, fp8_routed_problem, routed_problem

pytestmark = pytest.mark.gpu
BLOCKS = dict(block_m=128, block_n=128, block_k=64)


def _run(p, impl, splits, programs, places=None, rows=None):
    x, w = p["x"], p["weight"]
    row_start, tile_start = gemm2.expert_offsets(p["counts"].to(x.device), 128)
    y = torch.full((rows or x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype,
                   device=x.device)  # poisoned: every row the kernel owns must be written
    ready = torch.zeros(8, dtype=torch.int32, device=x.device)
    gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, ready, splits=splits,
                               programs=programs, **BLOCKS, places=places, impl=impl)
    torch.cuda.synchronize()
    return y, ready


@pytest.mark.parametrize("impl", ["gluon", "gluon_inline_publish"])
@pytest.mark.parametrize("case", ["ragged", "empty and hot experts"])
def test_gluon_gemm2_gives_the_triton_kernels_bits_and_publishes_every_split(impl, case):
    kw = dict(hot=True, empty=(3, 7, 59)) if case != "ragged" else {}
    p = routed_problem(0, 1, tokens=1500, experts=60, topk=4, ffn=704, hidden=2048,
                       seed=5, device="cuda", **kw)
    counts = p["counts"].tolist()
    ref = gemm2.grouped_gemm2_reference(p["x"], p["weight"], counts).float()
    row_tiles = sum(-(-c // 128) for c in counts)
    for splits, programs in ((1, 1), (3, 7), (4, 264)):
        want, want_ready = _run(p, "triton", splits, programs)
        got, ready = _run(p, impl, splits, programs)
        assert not torch.isnan(got).any()
        assert float((got.float() - ref).norm() / ref.norm()) < 1e-2
        assert torch.equal(got, want)
        col_tiles = -(-gemm2.split_width(2048, splits) // 128)
        assert ready[:splits].tolist() == [row_tiles * col_tiles] * splits
        assert torch.equal(ready, want_ready)


@pytest.mark.parametrize("experts", [16, 60])  # one mark word, two
def test_gluon_gemm2_places_token_major_rows_and_drops_bad_ones_as_the_triton_kernel_does(
        experts):
    """Both kernels find each row's place from the marks or read it from dest
    (`TokenPlaces`): the reference's places, every row written; rows whose token lies
    outside y dropped by both alike."""
    tokens, topk = 700, 2
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=topk, ffn=256, hidden=1024,
                       seed=6, device="cuda")
    marks, dest = token_places_reference(p["token_index"], p["counts"].tolist(), tokens, topk)
    words = -(-experts // 32)
    places = gemm2.TokenPlaces(p["token_index"], marks.cuda(), words, topk)
    rows_y, _ = _run(p, "triton", 2, 11)
    for impl in ("triton", "gluon"):
        for read in (places, places._replace(dest=dest.cuda().int())):
            got, _ = _run(p, impl, 2, 11, places=read)
            assert torch.equal(got[dest.cuda()], rows_y) and not got.isnan().any()
    bad = p["token_index"].clone()
    bad[::5] = tokens + 3  # outside y: dropped
    bad[1::7] = -1
    places = places._replace(token_index=bad)
    want, _ = _run(p, "triton", 2, 11, places=places)
    got, _ = _run(p, "gluon", 2, 11, places=places)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    kept = (bad >= 0) & (bad < tokens)
    assert int((~got.isnan().all(dim=1)).sum()) == int(kept.sum())


def test_gluon_gemm2_rejects_shapes_and_dtypes_it_is_not_written_for():
    p = routed_problem(0, 1, tokens=64, experts=4, topk=2, ffn=64, hidden=256, seed=7,
                       device="cuda")
    row_start, tile_start = gemm2.expert_offsets(p["counts"].cuda(), 128)
    y = torch.empty(p["x"].shape[0], 256, dtype=torch.bfloat16, device="cuda")
    ready = torch.zeros(4, dtype=torch.int32, device="cuda")
    common = dict(splits=1, programs=4, block_k=64, impl="gluon")
    with pytest.raises(ValueError, match="128 x"):
        gemm2.launch_grouped_gemm2(p["x"], p["weight"], y, row_start, tile_start, ready,
                                   block_m=64, block_n=128, **common)
    with pytest.raises(ValueError, match="bf16"):
        gemm2.launch_grouped_gemm2(p["x"].half(), p["weight"].half(), y.half(), row_start,
                                   tile_start, ready, block_m=128, block_n=128, **common)


def test_auto_picks_the_gluon_kernel_for_bf16_on_hopper_and_triton_otherwise():
    dev, bf16 = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert gemm2.resolve_impl("auto", dev, bf16, 128, 128, 4, True) == (
        "gluon" if hopper else "triton")
    assert gemm2.resolve_impl("auto", dev, torch.float16, 128, 128, 4, True) == "triton"
    assert gemm2.resolve_impl("auto", dev, bf16, 128, 256, 8, True) == "triton"
    assert gemm2.resolve_impl("auto", dev, bf16, 128, 128, 4, False) == "triton"  # rows
    assert gemm2.resolve_impl("triton", dev, bf16, 128, 128, 4, True) == "triton"
    fp8 = torch.float8_e4m3fn  # the Gluon kernel has no scales
    assert gemm2.resolve_impl("auto", dev, fp8, 128, 128, 4, True) == "triton"


def test_layer_elementwise_kernels_match_their_references_on_the_gpu_at_model_sizes():
    """The layer's one-pass kernels compiled for the GPU (the CPU suite runs them under the
    interpreter): weighted SwiGLU with and without a device row bound (Qwen's K = 1408),
    the gated shared add (H = 2048) and the bounded row gather, on poisoned outputs."""
    from megatron_overlap.kernels import gated_add, gather_rows, swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, k, h = 5000, 1408, 2048
    inter = torch.randn(rows, 2 * k, device="cuda", generator=g).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=g)
    want = swiglu.weighted_swiglu_reference(inter, probs).float()
    out = torch.full((rows, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    swiglu.weighted_swiglu(inter, probs, out=out)
    assert (out.float() - want).abs().max() <= 1e-2 * want.abs().max()
    valid = torch.tensor([3001], device="cuda")
    out = torch.full((rows, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    swiglu.weighted_swiglu(inter, probs, out=out, valid_rows=valid)
    assert (out[:3001].float() - want[:3001]).abs().max() <= 1e-2 * want.abs().max()
    assert out[3001:].isnan().all()

    routed = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    shared = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    logit = torch.randn(rows, 1, device="cuda", generator=g).bfloat16()
    ref = gated_add.add_gated_shared_reference(routed, shared, logit).float()
    fused = gated_add.add_gated_shared_(routed.clone(), shared, logit).float()
    assert (fused - ref).abs().max() <= 1e-2 * ref.abs().max()

    src = torch.randn(700, h, device="cuda", generator=g).bfloat16()
    index = torch.randint(0, 700, (rows,), device="cuda", generator=g)
    got = gather_rows.gather_rows(src, index, valid)
    assert torch.equal(got[:3001], src[index[:3001]])


@pytest.mark.parametrize("kind", ["tensor", "block"])
def test_fp8_gemm2_matches_the_fp64_product_of_its_dequantized_operands(kind):
    """The compiled FP8 kernel (e4m3 wgmma; kind "tensor" accumulates as TE's fprop does,
    without promotion; "block" promotes every 128-wide K step) on a model-sized problem
    with an empty expert and graded block magnitudes: near the float64 product of the
    dequantized operands (bf16's rounding plus the accumulation's error over |x| |W|^T),
    every row written, the same bits for every split count and grid, and a token-major y
    holding the row-order rows at the routing's places."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 GEMM2 is built for Hopper's e4m3 wgmma")
    tokens, topk = 1500, 4
    p = fp8_routed_problem(kind, per_expert_x=True, tokens=tokens, experts=16, topk=topk,
                           ffn=704, hidden=2048, empty=(3,), seed=9, device="cuda")
    ref, mag = fp8_reference(p)
    accumulation = 2.0 ** -8 if kind == "tensor" else 2.0 ** -10
    marks, dest = token_places_reference(p["token_index"], p["counts"].tolist(), tokens, topk)
    places = gemm2.TokenPlaces(p["token_index"], marks.cuda(), 1, topk, dest.cuda().int())
    row_start, tile_start = gemm2.expert_offsets(p["counts"].cuda(), 128)
    first = None
    for splits, programs, token_major in ((1, 1, False), (3, 7, True), (4, 264, False),
                                          (4, 264, True)):
        rows = tokens * topk if token_major else p["x"].shape[0]
        y = torch.full((rows, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
        ready = torch.zeros(8, dtype=torch.int32, device="cuda")
        gemm2.launch_grouped_gemm2(p["x"], p["weight"], y, row_start, tile_start, ready,
                                   splits=splits, programs=programs, block_m=128,
                                   block_n=128, block_k=128, places=places if token_major
                                   else None, scales=p["scales"], impl="auto")
        torch.cuda.synchronize()
        y = y[dest.cuda()] if token_major else y
        assert not y.isnan().any()
        err = (y.double() - ref).abs()
        assert (err <= 2.0 ** -8 * ref.abs() + accumulation * mag).all(), float(err.max())
        assert float(err.norm() / ref.norm()) < 1e-2
        first = y if first is None else first
        assert torch.equal(y, first)


def test_sum_rows_by_index_is_the_fp32_sum_rounded_once_on_the_gpu_at_a_training_size():
    """The permutation's backward compiled (the CPU suite interprets it, rounding toward
    zero): 65536 tokens x top-8 of 40 experts, H = 1536 (Granite's), Megatron's
    expert-major order, some tokens with fewer rows or none. Rounded to nearest once, the
    fp32 sum in row order has the CPU reference's bits, run after run."""
    from megatron_overlap.kernels import sum_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, topk, h = 65536, 8, 1536
    experts = torch.rand(tokens, 40, device="cuda", generator=g).topk(topk, dim=1).indices
    routed = torch.zeros(tokens, 40, dtype=torch.bool, device="cuda")
    routed.scatter_(1, experts, True)
    routed[::9, :20] = False  # fewer rows for some tokens
    routed[::97] = False  # none for others
    index = routed.T.nonzero()[:, 1].contiguous()  # expert-major, token-ascending
    rows = torch.randn(index.numel(), h, device="cuda", generator=g).bfloat16()
    got = sum_rows.sum_rows_by_index(rows, index, tokens)
    want = sum_rows.sum_rows_by_index_reference(rows, index, tokens, dtype=torch.float32)
    assert torch.equal(got.cpu(), want.bfloat16())
    assert (got[::97] == 0).all()
    assert torch.equal(got, sum_rows.sum_rows_by_index(rows, index, tokens))
