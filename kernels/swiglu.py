"""Weighted SwiGLU of the routed experts' FC1 output in one pass: out = silu(g) * u * p.

    inter [T, 2K] (row r = [gate g | up u], Megatron's GLU layout: torch.chunk(.., 2, -1))
    probs [T]     (the routing probability of each expert row)
    out   [T, K]  in inter's dtype, computed in fp32 and rounded once

This is Megatron's `weighted_bias_swiglu_impl` without a bias (what an MoE expert with
routing probabilities runs). Megatron compiles it with torch.compile; the rows per
expert change every call, so its kernel is built for a dynamic row count and moved
~1.3 TB/s on H200 at T = 262144, K = 1408 (1.65 ms), against ~4.4 TB/s for the shared
expert's static-shape SwiGLU beside it. Here the row count is a plain runtime argument
and each program moves a [BLOCK_R, BLOCK_K] tile of both halves with 16-byte accesses,
whatever T is: 0.56 ms there, ~4 TB/s (one H200, a profile of the layer by kernel kind).

Where the fp32 intermediates round: nowhere (as the compiled function; Megatron's eager
path rounds silu(g) and silu(g) * u to bf16 first). `weighted_swiglu_reference` below is
the same formula in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import LaunchCache, row_tile


@triton.jit(do_not_specialize=["rows"])
def weighted_swiglu_kernel(inter_ptr, probs_ptr, out_ptr, valid_ptr, rows, K: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_VALID: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    if HAS_VALID:  # only the device knows how many leading rows are real
        rows = tl.minimum(tl.load(valid_ptr).to(tl.int32), rows)
    if pid_r * BLOCK_R < rows:
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (r < rows)[:, None] & (c < K)[None, :]
        row64 = r.to(tl.int64)[:, None]
        gate = tl.load(inter_ptr + row64 * (2 * K) + c[None, :], mask=mask, other=0.0)
        up = tl.load(inter_ptr + row64 * (2 * K) + K + c[None, :], mask=mask, other=0.0)
        p = tl.load(probs_ptr + r, mask=r < rows, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * up.to(tl.float32) * p[:, None]
        tl.store(out_ptr + row64 * K + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


_SWIGLU = LaunchCache(weighted_swiglu_kernel)


def block_shape(k: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): the widest power-of-two column block up to 256 that divides K
    (1408 -> 128, 704 -> 64, 512 -> 256; no masked columns), 4096 elements a program."""
    return row_tile(k, 256)


def weighted_swiglu(inter: torch.Tensor, probs: torch.Tensor,
                    out: torch.Tensor | None = None,
                    valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u * p for inter [T, 2K] = [g | u] and probs [T] -> [T, K] (inter's dtype),
    into `out` when given (contiguous [T, K], inter's dtype). `valid_rows`: one integer
    on the device; only rows below it are computed (later ones keep out's contents), as
    where the postprocess padded the rows to a bound (`gather_rows`)."""
    if inter.dim() != 2 or inter.shape[1] % 2:
        raise ValueError(f"inter must be [T, 2K], got {tuple(inter.shape)}")
    rows, k = inter.shape[0], inter.shape[1] // 2
    if probs.shape not in ((rows,), (rows, 1)):
        raise ValueError(f"probs must be [T] = [{rows}] (or [T, 1]), got {tuple(probs.shape)}")
    if not inter.is_floating_point() or not probs.is_floating_point():
        raise ValueError(f"inter and probs must be floating point, got {inter.dtype}, "
                         f"{probs.dtype}")
    if inter.device != probs.device:
        raise ValueError(f"inter on {inter.device}, probs on {probs.device}")
    inter = inter.contiguous()
    probs = probs.reshape(rows).contiguous()
    if out is None:
        out = torch.empty(rows, k, dtype=inter.dtype, device=inter.device)
    elif (out.shape != (rows, k) or out.dtype != inter.dtype or out.device != inter.device
          or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous [{rows}, {k}] {inter.dtype} on "
                         f"{inter.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if valid_rows is not None and (valid_rows.numel() != 1 or valid_rows.is_floating_point()
                                   or valid_rows.device != inter.device):
        raise ValueError(f"valid_rows must be one integer on {inter.device}, got "
                         f"{tuple(valid_rows.shape)} {valid_rows.dtype} on {valid_rows.device}")
    if rows == 0 or k == 0:
        return out
    block_r, block_k = block_shape(k)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    valid = probs if valid_rows is None else valid_rows.reshape(1)  # (not read without it)
    _SWIGLU.launch(grid, (inter, probs, out, valid, rows),
                   dict(K=k, BLOCK_R=block_r, BLOCK_K=block_k,
                        HAS_VALID=valid_rows is not None, num_warps=4))
    return out


def weighted_swiglu_reference(inter: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The same formula in torch, fp32 throughout, rounded once to inter's dtype."""
    gate, up = inter.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up * probs.reshape(-1, 1).float()).to(inter.dtype)
