"""The FP8 GEMM2 (`gemm2_fp8`, scales of TE's recipes) against the float64 product of its
dequantized operands, under the interpreter (which takes e4m3 in tl.dot)."""

import pytest
import torch

from megatron_overlap.kernels import fp8_quant as q
from megatron_overlap.kernels import gemm2
from megatron_overlap.kernels.gemm2_fp8 import Fp8Scales, join_row_block_scales
from megatron_overlap.kernels.gemm2_places import token_places_reference
from routing_cases import fp8_reference, fp8_routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests")

TOKENS, TOPK, EXPERTS, FFN, HIDDEN = 19, 2, 4, 272, 200  # K: 3 K steps, the last partial
BLOCK = 16


def fp8_problem(kind: str, per_expert_x: bool = False):
    """A routed problem (expert 1 empty) quantized as `kind`'s recipe quantizes it."""
    return fp8_routed_problem(kind, per_expert_x, tokens=TOKENS, experts=EXPERTS, topk=TOPK,
                              ffn=FFN, hidden=HIDDEN, empty=(1,), seed=3)


def run(p, splits, programs, y=None, places=None, launcher=False, block_n=BLOCK):
    rows = p["x"].shape[0]
    if y is None:
        y = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    row_start, tile_start = gemm2.expert_offsets(p["counts"], BLOCK)
    ready = torch.zeros(8, dtype=torch.int32)
    kw = dict(splits=splits, programs=programs, block_m=BLOCK, block_n=block_n, block_k=128,
              places=places, scales=p["scales"])
    args = (p["x"], p["weight"], y, row_start, tile_start, ready)
    if launcher:
        gemm2.grouped_gemm2_launcher(*args, **kw)()
    else:
        gemm2.launch_grouped_gemm2(*args, **kw)
    return y, ready, tile_start


def assert_near_fp64(y: torch.Tensor, p) -> None:
    """|y - ref| <= one bf16 ulp of ref (the interpreter casts fp32 to bf16 by truncation;
    a GPU rounds to nearest) plus fp32 accumulation over K of |x| |W|^T."""
    ref, mag = fp8_reference(p)
    err = (y.double() - ref).abs()
    assert (err <= 2.0 ** -7 * ref.abs() + 2.0 ** -16 * mag).all(), float(err.max())


CASES = [("tensor", False), ("tensor", True), ("block", False)]


@pytest.mark.parametrize("kind, per_expert_x", CASES, ids=["tensor", "tensor_per_expert",
                                                          "block"])
def test_fp8_gemm2_rows_match_the_fp64_product_and_do_not_depend_on_splits_or_programs(
        kind, per_expert_x):
    """Rows of x's order, y poisoned and one wider and taller than the product: every
    element of [T, N] written and near the float64 product of the dequantized operands,
    nothing outside it written; the same bits for every split count, split width and
    number of programs (odd split widths put tiles across W's 128-row scale blocks)."""
    p = fp8_problem(kind, per_expert_x)
    assert p["counts"][1] == 0
    rows = p["x"].shape[0]
    first = None
    for splits, programs, launcher in ((1, 1, False), (3, 5, True), (2, 7, False)):
        big = torch.full((rows + 3, HIDDEN + 8), float("nan"), dtype=torch.bfloat16)
        y, ready, tile_start = run(p, splits, programs, y=big[:, :HIDDEN], launcher=launcher)
        assert not y[:rows].isnan().any() and big[rows:].isnan().all()
        assert big[:, HIDDEN:].isnan().all()
        assert_near_fp64(y[:rows], p)
        width = gemm2.split_width(HIDDEN, splits)
        cols = gemm2.split_col_tiles(HIDDEN, splits, width, BLOCK)
        want = [int(tile_start[-1]) * c for c in [cols[0]] * (splits - 1) + [cols[1]]]
        assert ready[:splits].tolist() == want
        first = y[:rows].clone() if first is None else first
        assert torch.equal(y[:rows], first)


@pytest.mark.parametrize("kind, per_expert_x", CASES, ids=["tensor", "tensor_per_expert",
                                                          "block"])
def test_fp8_gemm2_stores_token_major_rows_at_the_routings_places_and_nowhere_else(
        kind, per_expert_x):
    """SCATTER: row j lands at its dest row, bit for bit the row-order product's row;
    rows placed at -1 are dropped, and y's rows that no row is placed at stay NaN."""
    p = fp8_problem(kind, per_expert_x)
    rows_y, _, _ = run(p, splits=2, programs=3)
    marks, dest = token_places_reference(p["token_index"], p["counts"].tolist(), TOKENS, TOPK)
    dest = dest.to(torch.int32)
    dest[[0, 5]] = -1  # not placed: dropped
    y = torch.full(((TOKENS + 1) * TOPK, HIDDEN), float("nan"), dtype=torch.bfloat16)
    marks = torch.cat([marks, marks.new_zeros(1)])  # (a token that has no rows)
    run(p, splits=2, programs=3, y=y,
        places=gemm2.TokenPlaces(p["token_index"], marks, 1, TOPK, dest))
    kept = dest >= 0
    assert torch.equal(y[dest[kept].long()], rows_y[kept])
    written = torch.zeros(y.shape[0], dtype=torch.bool)
    written[dest[kept].long()] = True
    assert y[~written].isnan().all() and int(written.sum()) == int(kept.sum())


def test_block_scaled_gemm2_reads_the_scales_te_gives_a_per_expert_split():
    """x quantized split by expert, as TE's GroupedLinear does: the same bits as x whole
    (1x128 blocks never span rows), and its scales, joined, give the same y."""
    p = fp8_problem("block")
    counts = p["counts"].tolist()
    parts = [q.quantize_blockwise(rows, 1) for rows in p["x_hp"].split(counts)]
    bits = torch.cat([d for d, _ in parts]).view(torch.uint8)
    assert torch.equal(bits, p["x"].view(torch.uint8))
    joined = join_row_block_scales([s for _, s in parts], counts)
    assert torch.equal(joined, p["scales"].x_scale_inv[:, :p["x"].shape[0]])  # (unpadded)
    y, _, _ = run(p, 2, 3)
    p["scales"] = Fp8Scales("block", joined, p["scales"].w_scale_inv)
    assert torch.equal(run(p, 2, 3)[0], y)


def test_block_scaled_gemm2_with_the_widest_tile_reads_two_scale_blocks_of_w_per_tile():
    """BLOCK_N = 256 > 128: the columns of one tile span two 128-row blocks of W."""
    p = fp8_problem("block")
    y, _, _ = run(p, splits=1, programs=2, block_n=256)
    assert not y.isnan().any()
    assert_near_fp64(y, p)


def _bad_launch(p, **change):
    args = dict(x=p["x"], weight=p["weight"], scales=p["scales"], block_k=128, impl="triton",
                y=torch.empty(p["x"].shape[0], HIDDEN, dtype=torch.bfloat16))
    args.update(change)
    row_start, tile_start = gemm2.expert_offsets(p["counts"], BLOCK)
    gemm2.launch_grouped_gemm2(args["x"], args["weight"], args["y"], row_start, tile_start,
                               torch.zeros(8, dtype=torch.int32), splits=1, programs=1,
                               block_m=BLOCK, block_n=BLOCK, block_k=args["block_k"],
                               impl=args["impl"], scales=args["scales"])


def test_fp8_inputs_that_do_not_fit_raise_errors_naming_the_argument():
    p = fp8_problem("block")
    s, rows = p["scales"], p["x"].shape[0]
    t = fp8_problem("tensor")
    tx, tw = t["scales"].x_scale_inv, t["scales"].w_scale_inv
    t = dict(x=t["x"], weight=t["weight"])
    bad = [
        (dict(x=p["x"].view(torch.uint8)), "x is uint8"),
        (dict(x=p["x"].float().to(torch.float8_e5m2)), "x must be float8_e4m3fn.*e5m2"),
        (dict(weight=p["weight"].float().to(torch.float8_e5m2)), "weight must be"),
        (dict(scales=None), "need scales"),
        (dict(x=p["x"].float().bfloat16(), weight=p["weight"].float().bfloat16()),
         "x must be float8_e4m3fn with scales"),
        (dict(y=torch.empty(rows, HIDDEN)), "y must be bfloat16"),
        (dict(impl="gluon"), "Gluon kernel 'gluon' is bf16 only"),
        (dict(block_k=64), "block_k = 128"),
        (dict(scales=Fp8Scales("block", s.x_scale_inv[:, :rows - 1], s.w_scale_inv)),
         r"x_scale_inv must be \[ceil\(K/128\) = 3"),
        (dict(scales=Fp8Scales("block", s.x_scale_inv.t(), s.w_scale_inv)), "x_scale_inv"),
        (dict(scales=Fp8Scales("block", s.x_scale_inv, s.w_scale_inv[:, :1])),
         r"w_scale_inv must be \[E, ceil\(N/128\)"),
        (dict(scales=Fp8Scales("block", s.x_scale_inv, s.w_scale_inv[:, :, :2])),
         "w_scale_inv"),
        (dict(scales=Fp8Scales("tensor", s.x_scale_inv, s.w_scale_inv)), "x_scale_inv must hold"),
        (dict(t, scales=Fp8Scales("tensor", tx, tw[:3])), "w_scale_inv must hold E = 4"),
        (dict(t, scales=Fp8Scales("tensor", tx.to("meta"), tw)), "x's device"),
        (dict(x=p["x"][:, :200], scales=Fp8Scales("block", s.x_scale_inv[:2], s.w_scale_inv),
              weight=p["weight"][:, :, :200]), "multiple of 16"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            _bad_launch(p, **change)
    with pytest.raises(ValueError, match="Fp8Scales.kind must be one of"):
        Fp8Scales("row", s.x_scale_inv, s.w_scale_inv)
    with pytest.raises(TypeError, match="Fp8Scales.w_scale_inv must be a float32 tensor"):
        Fp8Scales("block", s.x_scale_inv, s.w_scale_inv.double())


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_overlap.kernels import gemm2

kernel = gemm2.grouped_gemm2_fp8_kernel
desc = "tensordesc<fp8e4nv[128,128]>"
types = {"x_desc": desc, "w_desc": desc, "y_ptr": "*bf16", "sx_ptr": "*fp32", "sw_ptr": "*fp32"}
for scaling in (1, 2):
    meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, EXPERTS_POW2=64, UPCAST=False,
                COL_ALIGN=16, FLATTEN=False, SCATTER=True, MARK_WORDS=2, FROM_DEST=True,
                SCALING=scaling)
    sig = {n: "constexpr" if n in meta else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    done = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=meta),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    ptx = done.asm["ptx"]
    print("SCALING", scaling, "e4m3 wgmma", ptx.count("wgmma.mma_async") > 0 and ".e4m3.e4m3" in ptx)
"""


def test_fp8_kernel_compiles_for_hopper_to_e4m3_wgmma_without_a_gpu():
    """The interpreter accepts code the compiler rejects (and `tools/compile_check.py`
    compiles the bf16 kernels): both scalings compile for sm_90, their dots e4m3 wgmma."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"SCALING {s} e4m3 wgmma True" for s in (1, 2)]
