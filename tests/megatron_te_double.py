"""Test-only: Megatron-Core's TE GPT spec built on CPU, TE's modules replaced by doubles.

Megatron-LM's default `--transformer-impl transformer_engine` builds its spec through
`TESpecProvider`, which needs Transformer Engine (CUDA). `install()` puts a provider double
in its place (and TENorm's), so Megatron's own spec code (`get_gpt_decoder_block_spec(...,
use_transformer_engine=True)`) chooses what it chooses with TE: TEGroupedMLP experts with
`--moe-grouped-gemm`, fused norm + QKV linear, biases as configured. The TE modules become:
GroupedLinear -> `GroupedLinearDouble` (tests/test_mcore_te_experts.py, TE's interface:
`weight0..`, `bias0..`), LayerNormColumnParallelLinear -> a norm then Megatron's
ColumnParallelLinear, TENorm -> torch's norm, TEDotProductAttention -> Megatron's local
attention. Never imported by the package. The GPU test with real TE is
tests/test_megatron_lm_launch_gpu.py.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from test_mcore_te_experts import GroupedLinearDouble


class NormDouble:
    """TENorm: LayerNorm or RMSNorm as config.normalization says (TE's persistent-kernel
    flag, on by Megatron-LM's default, means nothing to torch's norm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        return norm(hidden_size, eps=eps, dtype=config.params_dtype)


class LayerNormColumnParallelLinearDouble(ColumnParallelLinear):
    """TE's LayerNormColumnParallelLinear: the input norm, then the column-parallel linear."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm = NormDouble(config, input_size, eps=config.layernorm_epsilon)

    def forward(self, x, *args, **kwargs):
        return super().forward(self.layer_norm(x), *args, **kwargs)


class TESpecProviderDouble(LocalSpecProvider):
    """TESpecProvider's choices (fused norm + linear, grouped experts), CPU modules."""

    def linear(self) -> type:
        return ColumnParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return LayerNormColumnParallelLinearDouble

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False,
                   has_residual: bool = False):
        return NormDouble

    def core_attention(self) -> type:
        return DotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if not moe_use_grouped_gemm:  # SequentialMLP of (here: local) linears, as TE's
            return super().grouped_mlp_modules(False)
        return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=GroupedLinearDouble, linear_fc2=GroupedLinearDouble))

    def activation_func(self):
        return None


def install() -> None:
    """Megatron's TE spec code, from here on in this process, builds the doubles."""
    from megatron.core.models.gpt import gpt_layer_specs

    gpt_layer_specs.TESpecProvider = TESpecProviderDouble
    gpt_layer_specs.TENorm = NormDouble


__all__ = ["GroupedLinearDouble", "RowParallelLinear", "TESpecProviderDouble", "install"]
