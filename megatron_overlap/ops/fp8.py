"""FP8 operands of the op: e4m3 x and W with the scales of Transformer Engine's recipes.

    out = gemm2_gather_rs(x_fp8, w_fp8, counts, token_index, M, k, scales=Fp8Scales(...))

x [T, K] and weight [E, N, K] are TE's FP8 data viewed as `torch.float8_e4m3fn`;
`scales` is the kernel's `Fp8Scales(kind, x_scale_inv, w_scale_inv)` ("tensor":
`Float8CurrentScaling` / `DelayedScaling`; "block": `Float8BlockScaling`'s 1x128 x and
128x128 W blocks), with the layouts `kernels/gemm2_fp8.py` documents. GEMM2 accumulates
in fp32 and applies the scales; y, the partial sums and the output are bf16, and the
combine and reduce-scatter run as for bf16 operands.

Forward only: the backward of FP8 GEMM2 (dgrad, wgrad in the recipe's formats) is
TE's grouped GEMMs' work, not built yet, so a call that would build an autograd node
is refused (NotImplementedError) before anything runs. The Triton backends run the FP8
kernel (`grouped_gemm2_fp8_kernel`; "block" with BLOCK_K = 128, `fp8_tiles`); the
reference backend dequantizes the operands and multiplies in float64
(`grouped_gemm2_fp8_reference`, rounded to bf16 as the kernel's y), a checking path;
the Gluon GEMM2 has no scales and is refused (`planning.launch_tiles`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..kernels.fp8_quant import BLOCK, block_scale_shape
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
    with `scales` and `scales` with e4m3 operands of its shapes on x's device; a call
    that needs gradients is refused (`refuse_grads`)."""
    if scales is None:
        if x.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES:
            raise ValueError(f"x / weight are {x.dtype} / {weight.dtype}: FP8 operands need "
                             f"scales=Fp8Scales(kind, x_scale_inv, w_scale_inv)")
        return
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be an Fp8Scales, got {type(scales).__name__}")
    check_fp8_operands(x, weight, scales)  # (the op sets BLOCK_K = 128 for "block")
    refuse_grads(torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (probs is not None and probs.requires_grad)))


def refuse_grads(grads: bool) -> None:
    if grads:
        raise NotImplementedError(
            "gemm2_gather_rs on FP8 operands is forward only (inference, prefill): its "
            "backward is not built yet; call it under torch.no_grad with x, weight and "
            "probs that do not require grad")


@functools.lru_cache(maxsize=16)  # (on the launch path: one replace per tiles)
def fp8_tiles(tiles, fp8: str | None):
    """The tiles an FP8 launch of kind `fp8` runs: "block" takes BLOCK_K = 128 (one K
    step per scale block); "tensor" and bf16 keep the config's."""
    if fp8 == "block" and tiles.block_k != BLOCK:
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
