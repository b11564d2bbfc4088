"""Test-only double of Transformer Engine's FP8 GroupedLinear as TEGroupedMLP uses it, for
the FP8 layer on CPU (tests/test_mcore_te_fp8.py); the GPU test with real TE is
tests/test_mcore_te_fp8_gpu.py.

The contract mcore/te_fp8.py relies on, kept: `forward(x, m_splits)` quantizes each
expert's rows and weight with the recipe of `config.fp8_recipe` (kernels/fp8_quant.py's
emulation of TE's quantizers) into storages with TE 2.12's attribute names (`_data`,
`_scale_inv`; `_rowwise_data`, `_rowwise_scale_inv` in the GEMM-ready layouts) and calls
this module's `general_grouped_gemm(weights, inputs, [out], ...)` through the module's
globals, and in training drops the inputs' rowwise data after it, as TE's
`update_usage(rowwise_usage=False)` does; its autograd node computes dgrad and wgrad from
the dequantized operands. The
quantized weights are cached as Megatron's TEGroupedLinear has TE cache them: quantized
at a first microbatch (`is_first_microbatch`), read as they are at the others. Delayed
scaling keeps TE's state (`prepare_forward` / `end_forward`, `fp8_meta` with TE 2.12's
per-GEMM slots, the amaxes recorded at each cast and the scales updated by
`FP8GlobalStateManager`), and its backward quantizes dL/dy with the backward's. With
`fp8` off it is the bf16 double of tests/test_mcore_te_experts.py. `Fp8Padding` and
`Fp8Unpadding` pad each expert's rows to the alignment with zero rows, as TE's do. FP8
runs while `FP8GlobalStateManager.enabled` (TE: inside its autocast), else bf16.
"""

from __future__ import annotations

import torch
from test_mcore_te_experts import GroupedLinearDouble

from megatron_overlap.kernels import fp8_quant as q

CALLS = {"gemm": 0}


class FP8GlobalStateManager:
    """TE's FP8 state as GroupedLinear reads it: FP8 runs inside TE's autocast only.
    Delayed scaling: the fp8_meta of every module `prepare_forward` registered, their
    amaxes turned into scales by `reduce_and_update_fp8_tensors` (TE's update, one rank:
    no reduction), the forward's at the autocast's exit (`step`), the backward's by the
    step's first FP8 module (`is_first_fp8_module`)."""

    enabled = True
    IS_FIRST_FP8_MODULE = False
    registered: list = []
    updates = {True: 0, False: 0}

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.enabled

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        cls.updates[forward] += 1
        for meta in cls.registered:
            state = meta["scaling_fwd" if forward else "scaling_bwd"]
            history, scale = q.delayed_scale_update(state.amax_history, state.scale,
                                                    fp8_max=q.FP8_MAX[state.dtype])
            state.amax_history.copy_(history)
            state.scale.copy_(scale)

    @classmethod
    def step(cls, forward, backward) -> None:
        """One training step as TE's autocast brackets it: the forward inside, its exit's
        update, then the backward (whose first FP8 module updates the backward's)."""
        cls.IS_FIRST_FP8_MODULE = True
        out = forward()
        cls.reduce_and_update_fp8_tensors(forward=True)
        backward(out)


class _DelayedState:
    """TE's DelayedScalingRecipeState: a scale and an amax history per quantizer."""

    def __init__(self, quantizers: int, dtype, history: int = 1):
        self.dtype = dtype
        self.scale = torch.ones(quantizers)
        self.amax_history = torch.zeros(history, quantizers)


class Tensorwise:
    def __init__(self, data, scale_inv):
        self._data, self._scale_inv = data.view(torch.uint8), scale_inv.reshape(1)
        self.kept = self._data

    def values(self):
        return self.kept.view(torch.float8_e4m3fn).double() * self._scale_inv.double()

    def drop_rowwise(self):  # (TE's update_usage(rowwise_usage=False) after the GEMM)
        self._data = None


class Blockwise:
    def __init__(self, data, scale_inv, block_rows):
        self._rowwise_data, self._rowwise_scale_inv = data.view(torch.uint8), scale_inv
        self.block_rows, self.kept = block_rows, (self._rowwise_data, scale_inv)

    def values(self):
        data, scale_inv = self.kept
        return q.dequantize_blockwise(data.view(torch.float8_e4m3fn), scale_inv,
                                      self.block_rows)

    def drop_rowwise(self):
        self._rowwise_data = self._rowwise_scale_inv = None


def quantize(t: torch.Tensor, recipe: str, block_rows: int):
    if recipe == "blockwise":
        return Blockwise(*q.quantize_blockwise(t, block_rows), block_rows)
    return Tensorwise(*q.quantize_tensorwise(t))


def general_grouped_gemm(A, B, out, quantization_params, out_dtype, layout="TN",
                         m_splits=None, **kwargs):
    """out[0] rows of gemm i = B[i] @ A[i]^T, from the dequantized operands."""
    CALLS["gemm"] += 1
    rows = [b.values() @ a.values().t() for a, b in zip(A, B)]
    out[0].copy_(torch.cat(rows).to(out[0].dtype))
    return out, None, None


def _delayed(t: torch.Tensor, state: _DelayedState, slot: int):
    """(data, scale_inv) of t quantized with slot's scale, its amax recorded (TE's
    Float8Quantizer)."""
    amax = t.abs().amax().float() if t.numel() else torch.zeros(())
    state.amax_history[0, slot] = torch.maximum(state.amax_history[0, slot], amax)
    return q.quantize_with_scale(t, state.scale[slot], state.dtype)


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, recipe, qweights, training, module, *weights):
        if recipe == "delayed":
            fwd = module.fp8_meta["scaling_fwd"]
            inputs = [Tensorwise(*_delayed(xe, fwd, 3 * i))
                      for i, xe in enumerate(torch.split(x, m_splits))]
            ctx.module = module
            ctx.reduce_bwd = training and FP8GlobalStateManager.is_first_fp8_module()
        else:
            inputs = [quantize(xe, recipe, 1) for xe in torch.split(x, m_splits)]
        out = x.new_empty(x.shape[0], weights[0].shape[0])
        general_grouped_gemm(qweights, inputs, [out], [None] * len(weights), x.dtype)
        for t in inputs if training else ():  # (the wgrad reads the columnwise copy)
            t.drop_rowwise()
        ctx.operands, ctx.m_splits, ctx.dtypes = (inputs, qweights), m_splits, (x.dtype,)
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs, qweights = ctx.operands
        grads = list(torch.split(grad.double(), ctx.m_splits))
        if hasattr(ctx, "module"):  # (delayed: dL/dy quantized with the backward's scales)
            bwd = ctx.module.fp8_meta["scaling_bwd"]
            grads = [data.double() * scale_inv.double() for data, scale_inv in
                     (_delayed(g.float(), bwd, 2 * i) for i, g in enumerate(grads))]
        dx = torch.cat([g @ w.values() for g, w in zip(grads, qweights)])
        dws = [(g.t() @ xe.values()).float() for g, xe in zip(grads, inputs)]
        if getattr(ctx, "reduce_bwd", False):
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return (dx.to(ctx.dtypes[0]), None, None, None, None, None, *dws)


class GroupedLinearFp8Double(GroupedLinearDouble):
    """TE GroupedLinear's contract as TEGroupedMLP uses it, FP8 inside TE's autocast."""

    def __init__(self, *args, config, **kwargs):
        super().__init__(*args, config=config, **kwargs)
        self.config = config
        # Megatron's TEGroupedLinear: TE caches the FP8 weights at a first microbatch
        # and reads the cache at the others
        self.is_first_microbatch, self.workspace = True, None

    # TE 2.12's per-GEMM slots of fp8_meta under delayed scaling
    _offsets = {"input": 0, "weight": 1, "output": 2, "grad_output": 0, "grad_input": 1}
    _num_fp8_tensors_per_gemm = {"fwd": 3, "bwd": 2}

    def prepare_forward(self, inp, num_gemms: int = 1):
        """TE's: under delayed scaling the module's fp8_meta made (scales 1, amaxes 0) and
        registered for the updates; `end_forward` closes the bracket."""
        recipe = str(getattr(self.config.fp8_recipe, "value", self.config.fp8_recipe))
        self.brackets = getattr(self, "brackets", 0) + 1
        if recipe == "delayed" and not hasattr(self, "fp8_meta"):
            bwd = torch.float8_e5m2 if self.config.fp8 == "hybrid" else torch.float8_e4m3fn
            self.fp8_meta = {"scaling_fwd": _DelayedState(3 * num_gemms, torch.float8_e4m3fn),
                             "scaling_bwd": _DelayedState(2 * num_gemms, bwd)}
            FP8GlobalStateManager.registered.append(self.fp8_meta)
        return inp

    def end_forward(self):
        self.brackets -= 1

    def _quantized_weights(self, weights, recipe):
        if recipe != "delayed":
            return [quantize(w.detach(), recipe, 128) for w in weights]
        fwd = self.fp8_meta["scaling_fwd"]
        return [Tensorwise(*_delayed(w.detach(), fwd, 3 * i + 1)) for i, w in enumerate(weights)]

    def forward(self, x, m_splits):
        if not FP8GlobalStateManager.is_fp8_enabled():  # (TE: bf16 outside its autocast)
            return super().forward(x, m_splits)
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        recipe = str(getattr(self.config.fp8_recipe, "value", self.config.fp8_recipe))
        x = self.prepare_forward(x, self.num_gemms)
        if self.is_first_microbatch or self.workspace is None:
            self.workspace = self._quantized_weights(weights, recipe)
        out = _Fp8GroupedLinear.apply(x, list(m_splits), recipe, self.workspace,
                                      torch.is_grad_enabled(), self, *weights)
        self.end_forward()
        self.is_first_microbatch = False
        if self.use_bias:  # (the layer refuses an FC2 bias under FP8: FC1's returned)
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out, None


class _Aligned(torch.nn.Module):
    def __init__(self, num_gemms, align_size=None):
        super().__init__()
        self.align = align_size or 16

    def padded(self, m_splits) -> list[int]:
        return [-(-m // self.align) * self.align for m in m_splits]


class Fp8Padding(_Aligned):
    def forward(self, inp, m_splits):
        parts = []
        for rows, m, p in zip(torch.split(inp, list(m_splits)), m_splits, self.padded(m_splits)):
            parts += [rows, rows.new_zeros(p - m, *rows.shape[1:])]
        return torch.cat(parts), self.padded(m_splits)


class Fp8Unpadding(_Aligned):
    def forward(self, inp, m_splits):
        rows = torch.split(inp, self.padded(m_splits))
        return torch.cat([part[:m] for part, m in zip(rows, m_splits)])


def install() -> None:
    """Megatron's experts module pads with these where TE is absent, and TE's version
    checks of an FP8 config pass."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import experts

    experts.Fp8Padding, experts.Fp8Unpadding = Fp8Padding, Fp8Unpadding
    experts.HAVE_TE = True  # (TEGroupedMLP asserts it under FP8)
    transformer_config.is_te_min_version = lambda *args, **kwargs: True
