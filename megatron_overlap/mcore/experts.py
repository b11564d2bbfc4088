"""Grouped-GEMM experts for Megatron-Core MoE layers, and the FC1 / FC2 views the overlap needs.

Glossary (as in the op):
    T  rows of the expert-sorted activations (sum of tokens_per_expert)
    H  hidden size (= N, GEMM2's output width);  F  expert FFN size
    K  = F / expert-TP, the FC2 reduction dim on this rank;  E  local experts

`GroupedGemmExperts` is the fair non-TE stock baseline (docs/DESIGN.md): megatron-core 0.19 has
no grouped experts without Transformer Engine, and `SequentialMLP` runs a Python loop of
per-expert linears. It is a drop-in for Megatron's experts interface
(`forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output,
None)`), runs FC1 and FC2 through `torch._grouped_mm` on CUDA bf16 (a per-expert loop
elsewhere), applies the routing probabilities in the activation exactly like Megatron's
`MLP` (SequentialMLP's expert), and initializes its weights like SequentialMLP's linears
so the same seed gives the same weights.

`fc2_operands.py` gives `OverlapMoELayer` FC1 + activation output and the FC2 weight of
these experts, of Megatron's SequentialMLP and of its TEGroupedMLP.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.utils import get_pg_rank, get_pg_size

from ..ops import expert_of_rows_by_ends, grouped_mm_accepts, interpreting, weighted_swiglu


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs bf16 on Hopper and newer; elsewhere the loop is the path."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None,
                   device_counts: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ weight[e]^T, autograd-aware.

    x: [T, in] expert-sorted rows; weight: [E, out, in] (nn.Linear layout); counts: host
    list of rows per expert (sum T), or None with `device_counts` ([E] on x's device;
    with torch._grouped_mm the host need not know them; their sum may be below T, the
    rows past it padding). Returns [T, out] in x's dtype (padding rows unspecified).
    """
    # (no rows: the loop keeps the autograd graph; a layout breaking torch's 16-byte
    # stride rule, e.g. hidden 36 in bf16, would crash inside it: the loop too)
    if (_grouped_mm_ok(x) and x.shape[0] and grouped_mm_accepts(x)
            and grouped_mm_accepts(weight.transpose(1, 2))):
        if counts is None:  # (clamped: counts past T, which only a router breaking its
            # top-k could give, must not make the GEMM read past x; the caller redoes it)
            offs = torch.cumsum(device_counts, 0, dtype=torch.int32).clamp_(max=x.shape[0])
        else:
            offs = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
            offs = offs.to(x.device, non_blocking=True)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    if counts is None:
        counts = device_counts.tolist()
    parts, start = [], 0
    for e, n in enumerate(counts):
        # torch.matmul(x, w.t()) is what Megatron's linears compute: same bits as SequentialMLP.
        parts.append(torch.matmul(x[start:start + n], weight[e].t()))
        start += n
    if start < x.shape[0]:  # padding rows, as torch._grouped_mm leaves them
        parts.append(x.new_empty(x.shape[0] - start, weight.shape[1]))
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def mlp_activation(mlp, intermediate: torch.Tensor, bias: torch.Tensor | None,
                   probs: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron `MLP.forward`'s activation with per-token scale (0.19), for expert rows
    (every row, padding included: `valid_rows` is accepted and not used).

    mlp: anything with `.config` and `.activation_func` (an MLP expert or GroupedGemmExperts).
    intermediate: [T, ffn_out] FC1 output; probs: [T] routing probabilities. Returns [T, K]
    in intermediate's dtype; the probabilities are multiplied in here, before FC2.
    """
    config = mlp.config
    scale = probs.unsqueeze(-1)
    if config.use_te_activation_func:
        if bias is not None:
            intermediate = intermediate + bias
        out = mlp.activation_func(intermediate)
        return (out * scale).to(out.dtype)
    if config.bias_activation_fusion:
        if mlp.activation_func == F.silu and config.gated_linear_unit:
            return weighted_bias_swiglu_impl(intermediate, bias, scale,
                                             config.activation_func_fp8_input_store)
        if mlp.activation_func == quick_gelu and config.gated_linear_unit:
            return weighted_bias_quick_geglu_impl(
                intermediate, bias, scale, config.activation_func_fp8_input_store,
                config.glu_linear_offset, config.activation_func_clamp_value)
        raise ValueError("bias_activation_fusion with routing probabilities supports swiglu "
                         "and quick_geglu only (as Megatron's MLP)")
    if bias is not None:
        intermediate = intermediate + bias
    if config.gated_linear_unit:
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        out = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
    else:
        out = mlp.activation_func(intermediate)
    return (out * scale).to(out.dtype)


def fused_swiglu_applies(mlp, bias: torch.Tensor | None) -> bool:
    """Is `mlp`'s activation the plain weighted SwiGLU that `kernels.swiglu` computes (gated
    silu, no bias, offset or clamp, not TE's)? The overlapped layer then runs that kernel."""
    config = mlp.config
    return (bias is None and config.gated_linear_unit and mlp.activation_func is F.silu
            and not config.use_te_activation_func and not config.glu_linear_offset
            and config.activation_func_clamp_value is None)


def in_inference(module, tensors) -> bool:
    """Eval mode and no gradient through any of `tensors` (an iterable, read lazily): where
    the overlapped layer's one-pass kernels, which have no backward, may run. Eval mode
    too, since a training step's recompute runs its first forward without gradients and
    must give the bits it recomputes."""
    return not module.training and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def routed_activation(mlp, intermediate: torch.Tensor, bias: torch.Tensor | None,
                       probs: torch.Tensor, valid_rows: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The overlapped layer's activation: the one-pass Triton kernel where it computes the
    same function (on CUDA, or on CPU under the interpreter) in inference (`in_inference`),
    else Megatron's. `valid_rows` (device): the
    rows past it are padding, which the kernel skips (Megatron's computes them too)."""
    if (fused_swiglu_applies(mlp, bias) and in_inference(mlp, (intermediate, probs))
            and (intermediate.is_cuda or interpreting())):
        return weighted_swiglu(intermediate, probs, valid_rows=valid_rows)
    return mlp_activation(mlp, intermediate, bias, probs)


def grouped_fc1_activation(mlp, weight: torch.Tensor, bias: torch.Tensor | None,
                           x: torch.Tensor, tokens_per_expert, probs: torch.Tensor,
                           activation=None, device_counts=None,
                           valid_rows=None) -> torch.Tensor:
    """FC1 + activation with probs of experts `mlp` (its .config, .activation_func) whose
    FC1 is `weight` [E, G*F, H] (+ `bias` [E, G*F]): x [T, H] -> [T, K] (x's dtype).
    `activation`: (mlp, intermediate, bias, probs, valid_rows) -> output; None =
    Megatron's (`mlp_activation`). tokens_per_expert None: FC1 by `device_counts` (see
    `grouped_linear`), whose sum may be below T (`valid_rows`, on the device: the rows
    past it are padding, their output unspecified)."""
    x, probs = apply_probs_on_input(mlp.config, x, probs)
    counts = None if tokens_per_expert is None else host_counts(tokens_per_expert)
    inter = grouped_linear(x, weight, counts, device_counts)
    if bias is not None:  # in FC1, as TE's grouped linear adds it
        inter = inter + bias[expert_of_rows(counts, device_counts, x.shape[0], x.device)]
    return (activation or mlp_activation)(mlp, inter, None, probs, valid_rows)


def te_fc1_is_grouped(experts) -> bool:
    """Does the layer run FC1 of TEGroupedMLP `experts` as one grouped GEMM over its
    weights (`grouped_fc1_activation`), rather than through TE's GroupedLinear? Where the
    activation is one `mlp_activation` computes (not GLU-interleaved, not the fused
    squared ReLU): the same function, without TE's per-expert host split, so FC1 also
    runs on device counts (no host sync) and as torch._grouped_mm's one grouped GEMM."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    c = experts.config if isinstance(experts, TEGroupedMLP) else None
    # (FP8: FC1 is TE's quantized GroupedLinear, mcore/te_fp8.py)
    return (c is not None and not c.fp8 and not c.fp4 and c.moe_mlp_glu_interleave_size is None
            and not getattr(c, "use_fused_weighted_squared_relu", False))


def apply_probs_on_input(config, x: torch.Tensor, probs: torch.Tensor):
    """`moe_apply_probs_on_input`: scale the input rows and reset probs to 1, as 0.19 does."""
    if not config.moe_apply_probs_on_input:
        return x, probs
    if config.moe_router_topk != 1:
        raise ValueError("moe_apply_probs_on_input only works with moe_router_topk = 1")
    return (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)


class GroupedGemmExperts(MegatronModule):
    """E local experts as two stacked weights; FC1 and FC2 as grouped GEMMs.

    Parameters (expert-TP shards of F across `pg_collection.expt_tp`):
        fc1_weight: [E, G*F/tp, H], G = 2 for gated units ([gate_shard; up_shard] per
            expert, Megatron's stride-2 layout), else 1; params_dtype.
        fc2_weight: [E, H, F/tp]; FC2 returns a partial sum over expert-TP ranks, reduced
            by the dispatcher's combine (as Megatron's expert linears do).
        fc1_bias, fc2_bias (with `add_bias_linear`): [E, G*F/tp] and [E, H], zero at
            init as Megatron's. FC1's is added before the activation, FC2's as
            `bias[e] * prob[row]` after FC2, where TEGroupedMLP adds them.
    Same builder signature as Megatron's experts: (num_local_experts, config, *,
    pg_collection=None, name=None). No fp8 (ValueError).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        if config.fp8 or config.fp4:
            raise ValueError("GroupedGemmExperts runs bf16/fp16/fp32 only; fp8/fp4 need TE experts")
        if config.moe_latent_size:
            raise ValueError("GroupedGemmExperts does not support moe_latent_size")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self.num_local_experts = num_local_experts
        self.tp_group = pg_collection.expt_tp
        self.ep_group = pg_collection.ep
        tp, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        ffn = config.moe_ffn_hidden_size
        if ffn % tp:
            raise ValueError(f"expert-TP size {tp} must divide moe_ffn_hidden_size {ffn}")
        glu = 2 if config.gated_linear_unit else 1
        self.activation_func = config.activation_func
        hidden, k = config.hidden_size, ffn // tp
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(torch.empty(
            num_local_experts, glu * k, hidden, dtype=config.params_dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(
            num_local_experts, hidden, k, dtype=config.params_dtype, device=device))
        self.fc1_bias = self.fc2_bias = None
        if config.add_bias_linear:  # (zeros, as Megatron initializes biases)
            self.fc1_bias = torch.nn.Parameter(torch.zeros(
                num_local_experts, glu * k, dtype=config.params_dtype, device=device))
            self.fc2_bias = torch.nn.Parameter(torch.zeros(
                num_local_experts, hidden, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.fc1_bias, True, 1, glu)
            self.fc1_bias.allreduce = self.fc2_bias.allreduce = False
        if config.perform_initialization:
            self._initialize(glu, ffn, hidden, tp, rank)
        # Megatron's conventions: tensor-parallel along F, expert params (not all-reduced
        # over the dense DP group but over expert-DP).
        set_tensor_model_parallel_attributes(self.fc1_weight, True, 1, glu)
        set_tensor_model_parallel_attributes(self.fc2_weight, True, 2, 1)
        for p in (self.fc1_weight, self.fc2_weight):
            p.allreduce = False

    def _initialize(self, glu: int, ffn: int, hidden: int, tp: int, rank: int) -> None:
        """Expert by expert, FC1 then FC2, as SequentialMLP's linears draw their numbers."""
        config = self.config
        if config.use_cpu_initialization:
            for e in range(self.num_local_experts):
                w1 = torch.empty(self.fc1_weight.shape[1:], dtype=config.params_dtype)
                _initialize_affine_weight_cpu(
                    w1, glu * ffn, hidden, glu * ffn // tp, 0, config.init_method, stride=glu,
                    rank=rank, world_size=tp, skip_set_tensor_parallel_attributes=True)
                w2 = torch.empty(self.fc2_weight.shape[1:], dtype=config.params_dtype)
                _initialize_affine_weight_cpu(
                    w2, hidden, ffn, ffn // tp, 1, config.output_layer_init_method,
                    params_dtype=config.params_dtype, rank=rank, world_size=tp,
                    skip_set_tensor_parallel_attributes=True)
                with torch.no_grad():
                    self.fc1_weight[e].copy_(w1)
                    self.fc2_weight[e].copy_(w2)
            return
        with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for e in range(self.num_local_experts):
                config.init_method(self.fc1_weight[e])
                config.output_layer_init_method(self.fc2_weight[e])

    def fc1_activation(self, x: torch.Tensor, tokens_per_expert, probs: torch.Tensor,
                       activation=None, device_counts=None,
                       valid_rows=None) -> torch.Tensor:
        """FC1 + activation with probs: x [T, H] -> [T, K] (see `grouped_fc1_activation`)."""
        return grouped_fc1_activation(self, self.fc1_weight, self.fc1_bias, x,
                                      tokens_per_expert, probs, activation, device_counts,
                                      valid_rows)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert,
                permuted_probs: torch.Tensor):
        """[T, H] expert-sorted rows -> ([T, H] FC2 partial sums, None)."""
        h = self.fc1_activation(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = host_counts(tokens_per_expert)
        out = grouped_linear(h, self.fc2_weight, counts)
        if self.fc2_bias is None:
            return out, None
        rows = self.fc2_bias[expert_of_rows(counts, None, h.shape[0], h.device)]
        scale = bias_scale(self.config, permuted_probs)
        return (out + rows * scale.unsqueeze(-1)).to(out.dtype), None  # TEGroupedMLP's order

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        raise NotImplementedError(
            "GroupedGemmExperts has no distributed-checkpoint mapping yet; build the model "
            "with SequentialMLP experts (--moe-overlap works with both) to save checkpoints")


def bias_scale(config, probs: torch.Tensor) -> torch.Tensor:
    """What FC2's bias is multiplied by per row: the routing probability, or 1 where
    `moe_apply_probs_on_input` already applied it (Megatron resets probs to 1 there)."""
    return torch.ones_like(probs) if config.moe_apply_probs_on_input else probs


def expert_of_rows(counts: list[int] | None, device_counts: torch.Tensor | None,
                   rows: int, device: torch.device) -> torch.Tensor:
    """[rows] int64: the local expert of each expert-sorted row, from host or device
    counts without a host sync (rows past the counts' sum, padding, get the last expert)."""
    if counts is not None:
        device_counts = torch.tensor(counts).to(device, non_blocking=True)
    return expert_of_rows_by_ends(torch.cumsum(device_counts, 0), rows)


def needs_host_counts(experts, x: torch.Tensor, grouped_fp8: bool = False) -> bool:
    """Does FC1 of `experts` need the counts brought to the host (a per-expert split of
    device rows)? Not for grouped experts where torch._grouped_mm runs (FP8 experts: where
    the call runs the grouped FP8 path, `grouped_fp8`), nor on CPU, where the "device"
    counts already are host memory (their loop reads them for free)."""
    grouped = (isinstance(experts, GroupedGemmExperts) or te_fc1_is_grouped(experts)
               or grouped_fp8)
    return not (grouped and x.shape[0] and (x.device.type == "cpu" or _grouped_mm_ok(x)))


def host_counts(tokens_per_expert) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return tokens_per_expert.tolist()
    return list(tokens_per_expert)
