"""FP8 operands of the op: e4m3 x and W with the scales of Transformer Engine's recipes.

    out = gemm2_gather_rs(x_fp8, w_fp8, counts, token_index, M, k, scales=Fp8Scales(...))

x [T, K] and weight [E, N, K] are TE's FP8 data viewed as `torch.float8_e4m3fn`;
`scales` is the kernel's `Fp8Scales(kind, x_scale_inv, w_scale_inv)` ("tensor":
`Float8CurrentScaling` / `DelayedScaling`; "block": `Float8BlockScaling`'s 1x128 x and
128x128 W blocks), with the layouts `kernels/gemm2_fp8.py` documents. GEMM2 accumulates
in fp32 and applies the scales; y, the partial sums and the output are bf16, and the
combine and reduce-scatter run as for bf16 operands.

Training: the FP8 operands carry no gradient. GEMM2's backward (dgrad, wgrad in the
recipe's formats) is the caller's node `grad_sink` ([T, N], e.g. TE's GroupedLinear
run with its forward GEMM skipped): the op's backward hands it dL/dy, each row's token
gradient with its probability applied, and gives probs their gradient from y. The
combine's backward is the bf16 path's. The Triton backends run the FP8
kernel (`grouped_gemm2_fp8_kernel`, BLOCK_K = 128: `fp8_tiles`); the
reference backend dequantizes the operands and multiplies in float64
(`grouped_gemm2_fp8_reference`, rounded to bf16 as the kernel's y), a checking path;
the Gluon GEMM2 has no scales and is refused (`planning.launch_tiles`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..kernels.fp8_quant import (BLOCK, block_scale_shape, quantize_blockwise,
                                 quantize_tensorwise, quantize_tensorwise_splits)
from ..kernels.gemm2_fp8 import (FP8_DTYPES, SCALING, Fp8Scales, check_fp8_operands,
                                 grouped_gemm2_fp8_reference)

#: the dtype of y, the partial sums and the output of a call on FP8 operands
OUT_DTYPE = torch.bfloat16
#: the dtype the tiles are resolved for (`planning.resolved`: never the Gluon kernel)
OPERAND_DTYPE = torch.float8_e4m3fn


def check_kind(fp8) -> str | None:
    """`fp8` (a scaling kind, "tensor" or "block", or None: no FP8), else a ValueError."""
    if fp8 is not None and fp8 not in SCALING:
        raise ValueError(f"fp8 must be None or one of {tuple(SCALING)}, got {fp8!r}")
    return fp8


def kind_of(scales: Fp8Scales | None) -> str | None:
    return None if scales is None else scales.kind


def check_call(x, weight, scales, probs) -> None:
    """The op's FP8 checks (ValueError / TypeError naming the argument): FP8 operands come
    with `scales` and `scales` with e4m3 operands of its shapes on x's device, which carry
    no gradient themselves (`grad_sink` does: `check_sink`)."""
    if scales is None:
        if x.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES:
            raise ValueError(f"x / weight are {x.dtype} / {weight.dtype}: FP8 operands need "
                             f"scales=Fp8Scales(kind, x_scale_inv, w_scale_inv)")
        return
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be an Fp8Scales, got {type(scales).__name__}")
    check_fp8_operands(x, weight, scales)  # (the op sets BLOCK_K = 128 for "block")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError("FP8 x and weight must not require grad: their gradients are "
                         "the recipe's (dgrad and wgrad in FP8), which the op hands to "
                         "grad_sink's node instead of computing them")


def check_sink(x, weight, scales, grad_sink) -> None:
    """`grad_sink`: None, or a [T, N] floating tensor on x's device, the output of the
    caller's own node for GEMM2 (its values are never read): the op's backward hands it
    dL/dy, each row's token gradient with its probability applied, and that node computes
    dgrad and wgrad in the recipe's formats (TE's GroupedLinear with its forward GEMM
    skipped, mcore/te_fp8.py; the grouped FP8 experts' nodes, ops/fp8_train.py and
    ops/block_train.py, whose blockwise operands are bf16). x and weight then carry no
    gradient of their own. Where gradients are on it must need one."""
    if grad_sink is None:
        return
    if scales is None and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError("x / weight require grad and grad_sink is given: GEMM2's gradient "
                         "goes either to grad_sink's node or to x and weight, not both "
                         "(detach them, or pass no grad_sink)")
    if not isinstance(grad_sink, torch.Tensor) or not grad_sink.is_floating_point():
        raise TypeError(f"grad_sink must be a floating-point tensor, got "
                        f"{getattr(grad_sink, 'dtype', type(grad_sink).__name__)}")
    rows = (x.shape[0], weight.shape[1])
    if tuple(grad_sink.shape) != rows or grad_sink.device != x.device:
        raise ValueError(f"grad_sink must be [T, N] = {list(rows)} on {x.device} (GEMM2's "
                         f"output rows), got {list(grad_sink.shape)} on {grad_sink.device}")
    if torch.is_grad_enabled() and not grad_sink.requires_grad:
        raise ValueError("grad_sink does not require grad: nothing would receive GEMM2's "
                         "gradient (pass None where no gradient flows to x and weight)")


@functools.lru_cache(maxsize=16)  # (on the launch path: one replace per tiles)
def fp8_tiles(tiles, fp8: str | None):
    """The tiles an FP8 launch of kind `fp8` runs: BLOCK_K = 128, one K step per scale
    block under "block", and under "tensor" the 128 bytes of each row a bf16 tile reads
    at 64 (one H100, a GEMM2 wave over bf16's: 0.87x at the config's 64, 0.80x at 128);
    bf16 keeps the config's."""
    if fp8 is not None and tiles.block_k != BLOCK:
        return dataclasses.replace(tiles, block_k=BLOCK)
    return tiles


def reference_y(x, weight, counts: list[int], scales: Fp8Scales) -> torch.Tensor:
    """[T, N] bf16: the float64 product of the dequantized operands, rounded once (the
    reference path's GEMM2)."""
    return grouped_gemm2_fp8_reference(x, weight, counts, scales).to(OUT_DTYPE)


def compile_scales(fp8: str, rows: int, k: int, hidden: int, device) -> Fp8Scales:
    """Scales of one expert's [rows, k] x and [hidden, k] W in TE's layouts (padding
    included, so the strides the compile specializes on are a call's): what the
    residency's compile of the FP8 kernel takes (`residency.compiled_occupancies`)."""
    if fp8 == "tensor":
        return Fp8Scales(fp8, torch.ones(1, device=device), torch.ones(1, device=device))
    return Fp8Scales(fp8, torch.ones(block_scale_shape(rows, k, 1), device=device),
                     torch.ones(1, *block_scale_shape(hidden, k, BLOCK), device=device))


def quantize_operands(x: torch.Tensor, weight: torch.Tensor, counts: list[int], kind: str
                      ) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales]:
    """(x e4m3, weight e4m3, scales): GEMM2's operands x [T, K] (rows sorted by expert,
    `counts` each) and weight [E, N, K] quantized as TE's recipes quantize them: "tensor"
    one current scale per expert's rows of x and per W_e (TE's GroupedLinear splits its
    input by expert); "block" 1x128 x and 128x128 W blocks. For benchmarks and checks of
    the op on FP8 operands; the layer takes TE's own (mcore/te_fp8.py)."""
    if kind not in SCALING:
        raise ValueError(f"kind must be one of {tuple(SCALING)}, got {kind!r}")
    if x.dim() != 2 or weight.dim() != 3 or sum(counts) != x.shape[0]:
        raise ValueError(f"x [T, K], weight [E, N, K] and counts summing to T expected; "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}, sum {sum(counts)}")
    if kind == "block":
        xq, x_scale_inv = quantize_blockwise(x, 1)
        wq = [quantize_blockwise(w, BLOCK) for w in weight]
    else:
        xq, x_scale_inv = quantize_tensorwise_splits(x, counts)
        wq = [quantize_tensorwise(w) for w in weight]
    scales = Fp8Scales(kind, x_scale_inv, torch.stack([s for _, s in wq]))
    return xq, torch.stack([d for d, _ in wq]), scales
