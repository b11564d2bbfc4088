"""The gated shared expert's add into the routed output, in place, in one pass:

    out[t, :] += sigmoid(logit[t]) * shared[t, :]

    out    [T, H]  the MoE layer's routed (combined) output, updated in place
    shared [T, H]  the shared expert's output before its gate
    logit  [T]     the gate's logit per token (Megatron: linear(hidden, gate_weight))

Megatron's `SharedExpertMLP` multiplies its output by `sigmoid(logit)` ([T, 1] against
[T, H]: a broadcasting multiply that takes torch's non-vectorized elementwise path) and
`MoELayer.postprocess` then adds it to the routed output: two passes and a third tensor,
0.36 + 0.18 ms at Qwen S = 16384 on H200 (a profile of the layer by kernel kind). This moves the
same bytes once: read out and shared, write out.

Where it rounds: once, to out's dtype (Megatron rounds the sigmoid, the product and the
sum to bf16 each). `add_gated_shared_reference` below is the same formula in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import LaunchCache, row_tile


@triton.jit(do_not_specialize=["rows"])
def gated_add_kernel(out_ptr, shared_ptr, logit_ptr, rows, H: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (c < H)[None, :]
    offs = r.to(tl.int64)[:, None] * H + c[None, :]
    logit = tl.load(logit_ptr + r, mask=r < rows, other=0.0).to(tl.float32)
    gate = 1.0 / (1.0 + tl.exp(-logit))
    out = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (out + gate[:, None] * shared).to(out_ptr.dtype.element_ty),
             mask=mask)


_GATED_ADD = LaunchCache(gated_add_kernel)


def block_shape(h: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): the widest power-of-two column block up to 512 that divides H
    (2048 -> 512, 5120 -> 512, 1536 -> 512, 64 -> 64; no masked columns where one does),
    4096 elements a program."""
    return row_tile(h, 512)


def add_gated_shared_(out: torch.Tensor, shared: torch.Tensor,
                      logit: torch.Tensor) -> torch.Tensor:
    """out += sigmoid(logit) * shared per token, in place; returns out.

    out, shared: [..., H], the same shape, dtype and device, contiguous; logit: one value
    per token, [...] or [..., 1], floating point."""
    if out.shape != shared.shape or out.dim() < 1:
        raise ValueError(f"out and shared must have one shape [..., H], got "
                         f"{tuple(out.shape)} and {tuple(shared.shape)}")
    if out.dtype != shared.dtype or not out.is_floating_point():
        raise ValueError(f"out and shared must share a floating dtype, got {out.dtype} and "
                         f"{shared.dtype}")
    h = out.shape[-1]
    rows = out.numel() // h if h else 0
    if logit.numel() != rows or not logit.is_floating_point():
        raise ValueError(f"logit must hold one floating value per token ({rows}), got "
                         f"{tuple(logit.shape)} {logit.dtype}")
    if not (out.device == shared.device == logit.device):
        raise ValueError(f"out on {out.device}, shared on {shared.device}, logit on "
                         f"{logit.device}")
    if not (out.is_contiguous() and shared.is_contiguous()):
        raise ValueError("out and shared must be contiguous (out is updated in place)")
    if rows == 0 or h == 0:
        return out
    logit = logit.reshape(rows).contiguous()
    block_r, block_h = block_shape(h)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(h, block_h))
    _GATED_ADD.launch(grid, (out, shared, logit, rows),
                      dict(H=h, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4))
    return out


def add_gated_shared_reference(out: torch.Tensor, shared: torch.Tensor,
                               logit: torch.Tensor) -> torch.Tensor:
    """The same formula in torch, fp32 throughout, rounded once to out's dtype (new tensor)."""
    gate = torch.sigmoid(logit.float()).reshape(*out.shape[:-1], 1)
    return (out.float() + gate * shared.float()).to(out.dtype)
