"""The local sum after GatherRS: this rank's output rows are the fp32 sum, in rank order,
of the D partials its peers pushed into its receive slots (`kernels/gather_rs.py`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch_cache import LaunchCache


@triton.jit(do_not_specialize=["numel"])
def sum_partials_kernel(recv_ptr, out_ptr, epoch_ptr, numel, slot_stride, parity_stride,
                        WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over src of recv[src, i], in fp32 (recv slots are contiguous), where
    recv is the receive slots of the parity of the epoch at `epoch_ptr` (the call whose
    GatherRS has just stored it): recv_ptr + (epoch % 2) * parity_stride.

    The rank loop is unrolled (WORLD is a constexpr: one binary per group size) so the
    WORLD loads of a thread are in flight together; a runtime loop issued them one after
    another: 1.9x-2x less time on H200 (docs/RESULTS.md, "Kernel choices measured"). Same
    bits: the sum runs in rank order either way."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    recv_ptr += (tl.load(epoch_ptr) % 2).to(tl.int64) * parity_stride
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for src in tl.static_range(WORLD):
        acc += tl.load(recv_ptr + src * slot_stride + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


_SUM_PARTIALS = LaunchCache(sum_partials_kernel)


def launch_sum_partials(recv: torch.Tensor, out: torch.Tensor, world: int,
                        block: int = 2048, num_warps: int = 4, kernel=sum_partials_kernel,
                        epoch: torch.Tensor | None = None, parity_stride: int = 0):
    """recv [world, >=Md, N] contiguous slots -> out [Md, N] contiguous; with `epoch`, the
    slots `(epoch % 2) * parity_stride` elements past recv (the op's two parities). Block
    and warps: the fastest of 37 variants on one H200 at Md = 8192 and 32768, N = 2048
    (docs/RESULTS.md)."""
    epoch = epoch if epoch is not None else _zero_word(out.device)
    args = (recv, out, epoch, out.numel(), recv.stride(0), parity_stride)
    meta = dict(WORLD=world, BLOCK=block, num_warps=num_warps)
    grid = (triton.cdiv(out.numel(), block),)
    if kernel is sum_partials_kernel:
        return _SUM_PARTIALS.launch(grid, args, meta)
    return kernel[grid](*args, **meta)


@functools.lru_cache(maxsize=None)
def _zero_word(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def sum_partials_reference(recv: torch.Tensor, rows: int) -> torch.Tensor:
    """Pure torch: [rows, N] fp32 = recv[0, :rows] + recv[1, :rows] + ..., in rank order."""
    acc = recv[0, :rows].float()
    for src in range(1, recv.shape[0]):
        acc = acc + recv[src, :rows].float()
    return acc
