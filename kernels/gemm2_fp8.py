"""GEMM2 on FP8 operands: the scales of Transformer Engine's Hopper recipes, as the
grouped GEMM2 kernel (`gemm2.grouped_gemm2_fp8_kernel`, the bf16 kernel's body with a
constexpr SCALING) reads them, their checks, and a pure-torch reference.

    y[rows of e, :] = sum over K of x_fp8 * W_e_fp8, scaled (fp32 accumulate, bf16 y)

`Fp8Scales.kind`:
  * "tensor" (TE `Float8CurrentScaling`, `DelayedScaling`): y = (x @ W_e^T) *
    x_scale_inv[e] * w_scale_inv[e]. x_scale_inv: [] or [1] (x quantized as one tensor)
    or [E] (one per expert, as TE's GroupedLinear quantizes its input split by expert);
    w_scale_inv [E] (each expert's weight its own FP8 tensor). The scale multiplies the
    tile's accumulator once, after the K loop (TE's fprop: no split accumulator).
  * "block" (TE `Float8BlockScaling`): x in 1x128 blocks, x_scale_inv [ceil(K/128), >= T]
    with element [kb, row] (TE 2.12's "GEMM_READY" layout of a 1x128 rowwise
    scale_inv: roundup(T, 4) columns, any strides, so a compact [T, KB] tensor passes
    as its `.t()`); W_e in 128x128 blocks, w_scale_inv [E, ceil(N/128), >= ceil(K/128)]
    (TE's per-expert rowwise scale_inv [ceil(N/128), roundup(ceil(K/128), 4)], stacked).
    The K loop runs in 128-wide steps (BLOCK_K = 128), each step's product scaled before
    it is added: acc += (a @ b^T) * sx[rows, kb][:, None] * sw[e, cols // 128, kb][None, :]
    (DeepSeek-V3's promotion; each column finds its own 128-row block of W, so any
    BLOCK_N and split width work).

What a caller does with TE's tensors: FP8 data is uint8 in TE (`_rowwise_data`): pass
`data.view(torch.float8_e4m3fn)`. A 1x128 block never spans two rows, so quantizing x
whole or split by expert gives the same bits; TE's split tensors' scales join with
`join_row_block_scales`. Expert weights stack into [E, N, K] and their scales into
[E, ...] (`torch.stack`), once per weight update.

Worked example (block): K = 704 -> 6 K steps; x_scale_inv [6, 304] for T = 301 rows;
N = 2048 -> w_scale_inv [E, 16, 8]; the tile at columns 1664..1791, K step 2 reads
w_scale_inv[e, 13, 2] for all its columns and x_scale_inv[2, rows].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_quant import BLOCK, dequantize_blockwise

#: the SCALING constexpr of each kind (0: bf16 operands, no scales)
SCALING = {"tensor": 1, "block": 2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Scales:
    """The dequantization scales of an FP8 GEMM2 (fp32 tensors on x's device; shapes in
    the module docstring)."""

    kind: str
    x_scale_inv: torch.Tensor
    w_scale_inv: torch.Tensor

    def __post_init__(self):
        if self.kind not in SCALING:
            raise ValueError(f"Fp8Scales.kind must be one of {tuple(SCALING)}, got {self.kind!r}")
        for name in ("x_scale_inv", "w_scale_inv"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise TypeError(f"Fp8Scales.{name} must be a float32 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")


@triton.jit
def block_scale_ptrs(sx_ptr, sw_ptr, rows, end_row, col0, N, expert, sx_stride1, sw_stride0,
                     sw_stride1, BLOCK_N: tl.constexpr):
    """A tile's scale pointers at K step 0 (each row's 1x128 scale, each column's 128x128
    block of W_e) and which of them to read (rows of the tile's expert, columns < N)."""
    cols = col0 + tl.arange(0, BLOCK_N)
    sw_cols = sw_ptr + expert * sw_stride0 + (cols // 128) * sw_stride1
    return sx_ptr + rows * sx_stride1, sw_cols, rows < end_row, cols < N


@triton.jit
def block_scales(sx_rows, sw_cols, kb, row_ok, col_ok, sx_stride0, sw_stride2):
    """[BLOCK_M, BLOCK_N] fp32: the scale of each product of K step kb (rows past their
    expert and columns past N read nothing: their outputs are never stored)."""
    sx = tl.load(sx_rows + kb * sx_stride0, mask=row_ok, other=0.0)
    sw = tl.load(sw_cols + kb * sw_stride2, mask=col_ok, other=0.0)
    return sx[:, None] * sw[None, :]


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.float8_e4m3fn:
        return
    if t.dtype == torch.float8_e5m2:
        raise ValueError(f"{name} must be float8_e4m3fn: the forward GEMM2 takes e4m3 (e5m2 "
                         f"is TE's gradient format under the HYBRID recipe)")
    if t.dtype == torch.uint8:
        raise ValueError(f"{name} is uint8: view TE's raw FP8 data as its format, "
                         f"`.view(torch.float8_e4m3fn)`")
    raise ValueError(f"{name} must be float8_e4m3fn with scales, got {t.dtype}")


def check_operands(x, weight, y, scales: Fp8Scales | None, block_k: int, impl: str) -> None:
    """FP8 x and weight go with `scales` and the Triton kernel (ValueError naming what
    does not fit); bf16 operands must come without scales."""
    if scales is None:
        if x.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES:
            raise ValueError("FP8 x / weight need scales=Fp8Scales(...) to be dequantized")
        return
    if y.dtype != torch.bfloat16:
        raise ValueError(f"y must be bfloat16 for an FP8 GEMM2, got {y.dtype}")
    if impl not in ("triton", "auto"):
        raise ValueError(f"FP8 GEMM2 runs the Triton kernel (impl 'triton' or 'auto'); the "
                         f"Gluon kernel {impl!r} is bf16 only")
    check_fp8_operands(x, weight, scales, block_k)


def check_fp8_operands(x, weight, scales: Fp8Scales, block_k: int | None = None) -> None:
    """e4m3 x [T, K] and weight [E, N, K] with `scales` of their shapes on x's device
    (ValueError naming what does not fit); `block_k`: the K step of the launch (kind
    "block" needs 128), None where the caller chooses it."""
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    rows, k = x.shape
    experts, hidden, _ = weight.shape
    if k % 16:
        raise ValueError(f"K = {k} must be a multiple of 16 (16-byte FP8 rows for TMA)")
    for name in ("x_scale_inv", "w_scale_inv"):
        if getattr(scales, name).device != x.device:
            raise ValueError(f"Fp8Scales.{name} must be on x's device {x.device}")
    if scales.kind == "tensor":
        _check_tensor_scales(scales, experts)
    else:
        _check_block_scales(scales, rows, k, experts, hidden, block_k)


def _check_tensor_scales(scales: Fp8Scales, experts: int) -> None:
    if scales.x_scale_inv.numel() not in (1, experts):
        raise ValueError(f"Fp8Scales.x_scale_inv must hold 1 or E = {experts} scales for "
                         f"kind 'tensor', got shape {tuple(scales.x_scale_inv.shape)}")
    if scales.w_scale_inv.numel() != experts:
        raise ValueError(f"Fp8Scales.w_scale_inv must hold E = {experts} scales for kind "
                         f"'tensor', got shape {tuple(scales.w_scale_inv.shape)}")


def _check_block_scales(scales: Fp8Scales, rows: int, k: int, experts: int, hidden: int,
                        block_k: int | None) -> None:
    if block_k not in (None, BLOCK):
        raise ValueError(f"kind 'block' needs block_k = {BLOCK} (a K step per scale block), "
                         f"got {block_k}")
    kb = -(-k // BLOCK)
    sx, sw = scales.x_scale_inv, scales.w_scale_inv
    if sx.dim() != 2 or sx.shape[0] != kb or sx.shape[1] < rows:
        raise ValueError(f"Fp8Scales.x_scale_inv must be [ceil(K/128) = {kb}, >= {rows} rows] "
                         f"(TE's 1x128 layout), got {tuple(sx.shape)}")
    want = (experts, -(-hidden // BLOCK))
    if sw.dim() != 3 or tuple(sw.shape[:2]) != want or sw.shape[2] < kb:
        raise ValueError(f"Fp8Scales.w_scale_inv must be [E, ceil(N/128), >= ceil(K/128)] = "
                         f"[{want[0]}, {want[1]}, >= {kb}] (TE's 128x128 scales stacked), "
                         f"got {tuple(sw.shape)}")


def scale_operands(scales: Fp8Scales) -> tuple:
    """The FP8 kernel's arguments after the bf16 kernel's: (sx_ptr, sw_ptr, sx_stride0,
    sx_stride1, sw_stride0, sw_stride1, sw_stride2), strides in the tensors' dim order
    (kind "tensor": sx [1 or E] with stride 0 for one scale, sw [E])."""
    sx, sw = scales.x_scale_inv, scales.w_scale_inv
    if scales.kind == "tensor":
        sx, sw = sx.reshape(-1), sw.reshape(-1)
        return (sx, sw, sx.stride(0) if sx.numel() > 1 else 0, 0, sw.stride(0), 0, 0)
    return (sx, sw, sx.stride(0), sx.stride(1), *sw.stride())


def join_row_block_scales(scale_invs: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """One [ceil(K/128), T] x_scale_inv from TE's per-expert 1x128 scale_inv tensors (each
    [ceil(K/128), roundup(m_e, 4)], as GroupedLinear's `split_quantize` gives them)."""
    return torch.cat([s[:, :m] for s, m in zip(scale_invs, counts)], dim=1)


def grouped_gemm2_fp8_reference(x: torch.Tensor, weight: torch.Tensor, counts: list[int],
                                scales: Fp8Scales) -> torch.Tensor:
    """Pure torch, float64: y rows of expert e = dequantized x rows of e @ dequantized
    W_e^T (the exact product of the values the FP8 operands and scales stand for)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if scales.kind == "tensor":
            sx = scales.x_scale_inv.reshape(-1)
            xe = x[start:start + n].double() * float(sx[e if sx.numel() > 1 else 0])
            we = weight[e].double() * float(scales.w_scale_inv.reshape(-1)[e])
        else:
            xe = dequantize_blockwise(x[start:start + n],
                                      scales.x_scale_inv[:, start:start + n], 1)
            we = dequantize_blockwise(weight[e], scales.w_scale_inv[e], BLOCK)
        outs.append(xe @ we.t())
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1], dtype=torch.float64)
