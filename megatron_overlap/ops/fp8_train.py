"""Training through the grouped FP8 experts: FP8 dgrad and wgrad under current scaling
(or delayed scaling's given scales: `GradFp8.delayed`).

    rows = Fp8Rows(*quantize_fp8_groups(x, ends))                 # TE's current scaling
    y = fp8_expert_linear(x, ends, weight, params, rows)           # y[g] = x[g] W_g^T, bf16
    sink = fp8_expert_linear(h, ends, w2, params2, h_rows, compute=False)

`weight` is the stack of the E parameters `params` ([N, K] each) quantized one tensor per
expert (`Fp8Stack`). The forward is `fp8_grouped_linear`; with `compute=False` it is
skipped and the output ([R, N], never written) is the node the op's FP8 GEMM2 hands
dL/dy to (its `grad_sink`). The backward quantizes dL/dy as the forward quantized x (each
group one tensor, e4m3: Transformer Engine's current scaling under `--fp8-format e4m3`,
where gradients are e4m3 too) and runs, from the e4m3 operands TE's recipe makes:

    dgrad  dx[g] = dy[g] W_g       torch's scaled grouped GEMM, 2d x 3d; W_g's transpose
                                   is its e4m3 data transposed (one scale per tensor)
    wgrad  dW_g  = dy[g]^T x[g]    2d x 2d, contracting over each group's rows, which are
                                   copied as columns with each group's start at a multiple
                                   of 16 (`group_columns`: the GEMM's TMA needs 16-byte
                                   group starts and raises on others; one Triton launch,
                                   kernels/fp8_columns.py)

accumulating in fp32 with Hopper's fast FP8 accumulation. Under `--fp8-format hybrid`
(`GradFp8(torch.float8_e5m2)`: TE's gradients) dL/dy is rounded to e5m2 as TE's
quantizer rounds it, and stored in e4m3 (times a power of two per group, its scale_inv
divided by it: kernels/fp8_rows.py), since torch's scaled grouped GEMM takes e4m3 alone:
the products are e5m2's (exact for every value above 2^-14 of its group's largest) at
FP8's rate, where the bf16 grouped GEMM over the FP8 values cost a bf16 copy of every
operand and bf16's rate. TE splits the accumulator in
dgrad and wgrad; torch's grouped kernel with it split took 1.78 ms against 0.58 ms
(bf16: 0.64 ms) for Qwen's FC2 wgrad at 4 x 4096 on one H100
(docs/data/scaled_grouped_mm_probe_h100.json), and lost the gain. Off sm90 the products
are the dequantized operands' in fp32, group by group (a checking path).

`wgrad_into` (optional) takes the experts' weight gradients instead of autograd:
`wgrad_into([dW_0, ..])` returns what autograd gets for each parameter (Megatron's fused
gradient accumulation adds them into the parameters' main_grad and returns placeholders).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ..kernels.fp8_columns import group_columns as group_columns_kernel
from ..kernels.fp8_columns import group_columns_reference, transpose_stack
from .config import interpreting
from .fp8_groups import (DelayedScales, _scaled_grouped_mm_ok, fp8_grouped_linear,
                         quantize_fp8_groups)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Fp8Rows(NamedTuple):
    """Rows quantized by group (`quantize_fp8_groups`): e4m3 data [R, K], each group's
    scale_inv [E] and each row's [R] (0 on padding rows)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    row_scale_inv: torch.Tensor


class Fp8Stack(NamedTuple):
    """An expert weight stack quantized per expert: e4m3 data [E, N, K], scale_inv [E],
    and `transposed` [E, K, N] (the same e4m3 values, for dgrad; None where no gradient
    flows: made on demand)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    transposed: torch.Tensor | None = None


def with_transposed(weight: Fp8Stack) -> Fp8Stack:
    """`weight` with its `transposed` data ([E, K, N], one launch on CUDA and under the
    interpreter: kernels/fp8_columns.py), made where it has none."""
    if not isinstance(weight, Fp8Stack):
        raise TypeError(f"weight must be an Fp8Stack, got {type(weight).__name__}")
    if weight.transposed is not None:
        return weight
    data = weight.data
    if data.is_cuda or interpreting():
        return weight._replace(transposed=transpose_stack(data))
    return weight._replace(transposed=data.transpose(1, 2).contiguous())


def group_columns(q: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qt [K, C] e4m3, column_ends int32 [E]): the rows of q [R, K] before ends[-1] as
    columns, group g's from column column_ends[g-1], each group's width rounded up to
    16 with zero columns (kernels/fp8_columns.py: one launch on CUDA and under
    the interpreter; elsewhere its pure-torch reference, which reads the ends on the
    host)."""
    if q.is_cuda or interpreting():
        return group_columns_kernel(q, ends)
    return group_columns_reference(q, ends)


def fp8_grouped_wgrad(dy: Fp8Rows, x: Fp8Rows, ends: torch.Tensor) -> torch.Tensor:
    """dW [E, N, K] bf16: dW[g] = dy[g]^T x[g] from the dequantized e4m3 rows dy [R, N]
    and x [R, K], the groups' rows ending at ends (rows past ends[-1] not read)."""
    groups, n, k = ends.numel(), dy.data.shape[1], x.data.shape[1]
    if _scaled_grouped_mm_ok(dy.data) and n % 16 == 0 and k % 16 == 0:
        dy_t, column_ends = group_columns(dy.data, ends)
        x_t, _ = group_columns(x.data, ends)
        return torch._scaled_grouped_mm(
            dy_t, x_t.t(), dy.scale_inv.float().repeat_interleave(n),
            x.scale_inv.float().repeat_interleave(k), offs=column_ends,
            out_dtype=torch.bfloat16, use_fast_accum=True)
    out = torch.zeros(groups, n, k, dtype=torch.bfloat16, device=dy.data.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        a = dy.data[start:end].float() * dy.scale_inv[g].float()
        b = x.data[start:end].float() * x.scale_inv[g].float()
        out[g] = (a.t() @ b).to(torch.bfloat16)
        start = end
    return out


def _through_last_row(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """ends with the last group running to row `rows`: the padding rows (zero data, zero
    scale) then come out of a grouped GEMM as zeros instead of unwritten."""
    return torch.cat([ends[:-1], ends.new_full((1,), rows)])


def _counts(ends: torch.Tensor) -> torch.Tensor:
    return torch.diff(ends, prepend=ends.new_zeros(1))


class _Fp8ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ends, weight, rows, compute, grad: "GradFp8", wgrad_into, *params):
        ctx.save_for_backward(rows.data, rows.scale_inv, ends)
        ctx.weight, ctx.wgrad_into, ctx.grad = weight, wgrad_into, grad
        ctx.x_dtype, ctx.param_dtypes = x.dtype, [p.dtype for p in params]
        if compute:
            return fp8_grouped_linear(rows.data, rows.row_scale_inv, weight.data,
                                      weight.scale_inv, ends)
        return x.new_empty(rows.data.shape[0], weight.data.shape[1])

    @staticmethod
    def backward(ctx, dy):
        data, scale_inv, ends = ctx.saved_tensors
        w, grad = ctx.weight, ctx.grad
        dq = Fp8Rows(*quantize_fp8_groups(dy.contiguous(), ends, dtype=grad.dtype,
                                          delayed=grad.delayed, carrier=E4M3))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8_grouped_linear(dq.data, dq.row_scale_inv, with_transposed(w).transposed,
                                    w.scale_inv,
                                    _through_last_row(ends, dq.data.shape[0]))
            dx = dx.to(ctx.x_dtype)
        dws = [None] * len(ctx.param_dtypes)
        if any(ctx.needs_input_grad[7:]):
            x_rows = Fp8Rows(data, scale_inv, None)
            dw = fp8_grouped_wgrad(dq, x_rows, ends)
            dws = weight_gradients(dw, ctx.wgrad_into, ctx.param_dtypes)
        if grad.after_backward is not None:
            grad.after_backward()
        return (dx, None, None, None, None, None, None, *dws)


class GradFp8(NamedTuple):
    """How a grouped FP8 linear's backward quantizes dL/dy: `dtype` e4m3, or e5m2 (TE's
    gradients under `--fp8-format hybrid`); `delayed`, delayed scaling's scales and amax
    slots (None: current scaling); `after_backward`, called once its backward is done
    (TE's backward amax reduction where the linear was the step's first FP8 module)."""

    dtype: torch.dtype = E4M3
    delayed: DelayedScales | None = None
    after_backward: Callable[[], None] | None = None


def weight_gradients(dw: torch.Tensor, wgrad_into, dtypes) -> list:
    """What autograd gets for each expert's parameter from dW [E, N, K]: `wgrad_into`'s
    answer (Megatron's fused accumulation), else each expert's slice in its dtype."""
    if wgrad_into is not None:
        return list(wgrad_into(list(dw.unbind(0))))
    return [g.to(dtype) for g, dtype in zip(dw.unbind(0), dtypes)]


def _check_linear(x, ends, weight, params, rows, grad: GradFp8) -> None:
    if not isinstance(grad, GradFp8):
        raise TypeError(f"grad must be a GradFp8, got {type(grad).__name__}")
    if grad.dtype not in (E4M3, E5M2):
        raise ValueError(f"grad.dtype must be torch.float8_e4m3fn or torch.float8_e5m2 "
                         f"(TE's gradient formats), got {grad.dtype}")
    if not isinstance(weight, Fp8Stack) or not isinstance(rows, Fp8Rows):
        raise TypeError(f"weight must be an Fp8Stack and rows an Fp8Rows, got "
                        f"{type(weight).__name__}, {type(rows).__name__}")
    e, n, k = weight.data.shape
    if len(params) != e or any(tuple(p.shape) != (n, k) for p in params):
        raise ValueError(f"params must be the stack's {e} weights of [{n}, {k}], got "
                         f"{[tuple(p.shape) for p in params]}")
    if rows.data.shape[1] != k or ends.numel() != e:
        raise ValueError(f"rows [R, {rows.data.shape[1]}] / ends of {ends.numel()} groups "
                         f"do not match the stack [{e}, {n}, {k}]")
    grads = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if grads and x.shape != rows.data.shape:
        raise ValueError(f"x {tuple(x.shape)} must be the rows quantized in `rows` "
                         f"{tuple(rows.data.shape)} where gradients flow")


def fp8_expert_linear(x: torch.Tensor, ends: torch.Tensor, weight: Fp8Stack,
                      params: Sequence[torch.Tensor], rows: Fp8Rows | None = None,
                      compute: bool = True,
                      wgrad_into: Callable[[list[torch.Tensor]], list] | None = None,
                      grad: GradFp8 = GradFp8()) -> torch.Tensor:
    """[R, N] bf16: y[rows of g] = x[rows of g] W_g^T on the FP8 operands (x quantized
    here unless `rows` gives it quantized), with FP8 dgrad and wgrad to x and `params`
    (module doc). `compute=False`: the product is left to the caller (the op's FP8
    GEMM2), the output is only the node of its backward. `grad`: how dL/dy is quantized
    (`GradFp8`: e4m3 or e5m2, current or delayed scaling)."""
    if rows is None:
        rows = Fp8Rows(*quantize_fp8_groups(x, ends))
    _check_linear(x, ends, weight, params, rows, grad)
    return _Fp8ExpertLinear.apply(x, ends, weight, rows, compute, grad, wgrad_into, *params)
