"""Grouped GEMMs of the reference path and the op's backward, over `torch._grouped_mm`.

Glossary: T rows (expert-sorted, sum of the counts), E experts, R the reduction dim of a
product, C its output columns. For GEMM2 (N hidden, K FC width):
    forward  y[T, N]     = x[rows of e] @ W[e]^T         grouped_mm(x, W^T)   R = K
    dgrad    dx[T, K]    = dy[rows of e] @ W[e]          grouped_mm(dy, W)    R = N
    wgrad    dW[E, N, K] = dy[rows of e]^T @ x[rows of e] grouped_wgrad(dy, x)

The 16-byte requirement. torch._grouped_mm (ATen GroupedMMUtils.h, CPU and CUDA alike)
takes an operand only if, of its last two dims, one has unit stride and the other a
stride that is a multiple of 16 bytes (8 bf16 or 4 fp32 elements), and its output rows it
pads itself. A hidden size of 36 in bf16 (72-byte rows: Megatron's router test sizes) or
an FC width of 20 breaks it: a plain call raises "strides should be multiple of 16 bytes"
from inside torch. `accepts` states the rule; where an operand breaks it, the functions
below copy the operands once into zero-padded layouts that keep it. Zero columns in the
reduction add exact zeros and padded output columns are sliced off, so the result is the
unpadded product. Model widths (multiples of 64) never copy.

Where torch has no grouped kernel worth calling (CUDA other than bf16 on sm90+: there
its fallback copies the offsets to the host and loops over groups, as we would; float64
anywhere), a loop over experts computes the same products.
"""

from __future__ import annotations

import functools

import torch

#: torch._grouped_mm's alignment of operand strides and data pointers
ALIGN_BYTES = 16
_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _cpu_grouped_mm() -> bool:
    """Whether this torch runs torch._grouped_mm on CPU (2.13 does; older builds may not)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    a, b = torch.zeros(8, 8), torch.zeros(1, 8, 8)
    try:
        torch._grouped_mm(a, b, offs=torch.tensor([8], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_kernel(t: torch.Tensor) -> bool:
    """Whether torch._grouped_mm is the path for operands like t (else the loop)."""
    if t.dtype not in _GROUPED_DTYPES:
        return False
    if t.is_cuda:  # CUTLASS grouped kernels: bf16 on Hopper and newer
        return (t.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
                and torch.cuda.get_device_capability(t.device)[0] >= 9)
    return t.device.type == "cpu" and _cpu_grouped_mm()


def accepts(t: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes t's layout as it is: a 16-byte aligned base, and
    of its last two dims one of unit stride, the other's stride a multiple of 16 bytes."""
    align = ALIGN_BYTES // t.element_size()
    (s0, s1), (n0, n1) = t.stride()[-2:], t.shape[-2:]
    if t.data_ptr() % ALIGN_BYTES:
        return False
    if s1 == 1 and s0 >= max(1, n1):
        return s0 % align == 0
    if s0 == 1 and s1 >= max(1, n0):
        return s1 % align == 0
    return False


def _aligned_width(t: torch.Tensor, cols: int) -> int:
    align = ALIGN_BYTES // t.element_size()
    return -(-cols // align) * align


def _padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t with its last dim zero-padded to cols, row-contiguous; t itself if it already is
    and `accepts` it."""
    if t.shape[-1] == cols and t.stride(-1) == 1 and accepts(t):
        return t
    out = t.new_zeros(*t.shape[:-1], cols)
    out[..., :t.shape[-1]] = t
    return out


def expert_of_rows_by_ends(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64: the group of each row of groups ending at `ends` [E] (on the device,
    no host sync); rows past ends[-1], padding, get the last group."""
    index = torch.arange(rows, device=ends.device)
    return torch.searchsorted(ends, index, right=True).clamp_(max=ends.numel() - 1)


def offsets(counts_dev: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[E] int32 end row of each expert, on `device` (no host sync)."""
    return counts_dev.to(device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _host(counts_dev: torch.Tensor, counts: list[int] | None) -> list[int]:
    return counts if counts is not None else counts_dev.tolist()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts_dev: torch.Tensor,
               counts: list[int] | None) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]: a [T, R], b [E, R, C] (any strides), out
    [T, C] in a's dtype. counts: host rows per expert, or None (then `counts_dev` [E] on
    a's device: the grouped kernel needs no host copy)."""
    if not grouped_kernel(a):
        out = a.new_empty(a.shape[0], b.shape[2])
        start = 0
        for e, n in enumerate(_host(counts_dev, counts)):
            if n:
                torch.matmul(a[start:start + n], b[e], out=out[start:start + n])
            start += n
        return out
    if a.shape[0] == 0:
        return a.new_empty(0, b.shape[2])
    if not (accepts(a) and accepts(b)):
        # pad R, the reduction, with zeros in both; b R-contiguous ([E, C, R] in memory)
        # so that only R's stride has to be aligned, whatever C is
        r = _aligned_width(a, a.shape[1])
        a = _padded(a, r)
        b = _padded(b.transpose(1, 2), r).transpose(1, 2)
    return torch._grouped_mm(a, b, offs=offsets(counts_dev, a.device))


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, counts_dev: torch.Tensor,
                  counts: list[int] | None) -> torch.Tensor:
    """dW[e] = dy[rows of e]^T @ x[rows of e]: dy [T, C], x [T, R] -> [E, C, R] in x's
    dtype (nn.Linear's weight layout), exactly zero for an expert with no rows."""
    experts = counts_dev.numel() if counts is None else len(counts)
    if not grouped_kernel(x) or x.shape[0] == 0:
        dw = x.new_zeros(experts, dy.shape[1], x.shape[1])
        start = 0
        for e, n in enumerate(_host(counts_dev, counts) if x.shape[0] else ()):
            if n:
                torch.matmul(dy[start:start + n].t(), x[start:start + n], out=dw[e])
            start += n
        return dw
    c, r = dy.shape[1], x.shape[1]
    offs = offsets(counts_dev, x.device)
    if accepts(dy.t()) and accepts(x):  # dy^T reads dy's rows: C must be aligned, x's R
        dw = torch._grouped_mm(dy.t(), x, offs=offs)
    else:  # zero columns give zero rows / columns of dW, cut off
        dw = torch._grouped_mm(_padded(dy, _aligned_width(dy, c)).t(),
                               _padded(x, _aligned_width(x, r)), offs=offs)
        dw = dw[:, :c, :r].contiguous()
    return _zero_unrouted(dw, counts_dev, counts)


def _zero_unrouted(dw: torch.Tensor, counts_dev: torch.Tensor,
                   counts: list[int] | None) -> torch.Tensor:
    """dW of the experts without rows set to zero. The kernel's output is uninitialized
    memory and an empty group's share is only as good as the kernel: zero on CPU and
    Hopper, garbage on Blackwell (pytorch#172439, open). Host counts: only those experts
    are written; device counts: one masked pass over dW (the layer's training path passes
    host counts)."""
    if counts is not None:
        empty = [e for e, n in enumerate(counts) if n == 0]
        if empty:
            dw[empty] = 0
        return dw
    return dw.masked_fill_((counts_dev == 0).to(dw.device).view(-1, 1, 1), 0)
