"""OverlapMoELayer over Megatron's own TEGroupedMLP (Megatron-LM's default experts), on CPU.

Transformer Engine needs CUDA, so TE's GroupedLinear is replaced by a pure-torch double
with its interface (`weight0..`, `bias0..`, `forward(x, m_splits)`, FC2's bias returned
for the caller to add); Megatron's TEGroupedMLP code around it is the real one. The GPU
test with real TE is tests/test_mcore_gpu.py::test_te_grouped_experts_fuse.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")


class GroupedLinearDouble(torch.nn.Module):
    """TE GroupedLinear's contract as TEGroupedMLP uses it (bf16/fp32, no fp8)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection=None, name=None):
        super().__init__()
        self.use_bias, self.skip_bias_add, self.num_gemms = bias, skip_bias_add, num_gemms
        for i in range(num_gemms):
            w = torch.empty(output_size, input_size, dtype=config.params_dtype)
            init_method(w)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.randn(output_size, dtype=config.params_dtype)))

    def forward(self, x, m_splits):
        outs = []
        for i, xe in enumerate(torch.split(x, m_splits)):
            y = xe @ getattr(self, f"weight{i}").t()
            if self.use_bias and not self.skip_bias_add:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        out = torch.cat(outs)
        if self.use_bias and self.skip_bias_add:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out, None


def _te_moe_spec(linear=GroupedLinearDouble):
    """The MoE layer spec with TEGroupedMLP experts over `linear` (TE's GroupedLinear
    contract)."""
    import dataclasses
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp
    experts = partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=linear, linear_fc2=linear))
    return partial(spec.func, *spec.args, **dict(
        spec.keywords, submodules=dataclasses.replace(spec.keywords["submodules"],
                                                      experts=experts)))


def _te_scenarios(rank, world):
    import warnings

    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps
    from test_mcore_layer import _config, _rel_diff, _run

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(7 + rank)
    x, grad = torch.randn(12, 2, 32, generator=g), torch.randn(12, 2, 32, generator=g)
    spec, found = _te_moe_spec(), {}
    for bias in (False, True):
        config = _config(1, world, add_bias_linear=bias, bias_dropout_fusion=False,
                         moe_shared_expert_intermediate_size=None)
        torch.manual_seed(1234)
        stock = spec(config=config)
        ref = _run(stock, x, grad)
        for backend in ("reference", "interpret"):
            layer = with_overlap_moe(spec, OverlapConfig(backend=backend))(config=config)
            layer.load_state_dict(stock.state_dict())
            fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="megatron-overlap")
                out, dx, grads = _run(layer, x, grad)
            # the stacks the GEMMs read are views of weight0.. (packed at construction)
            view = all(stack._value.untyped_storage().data_ptr()
                       == linear.weight0.untyped_storage().data_ptr()
                       for stack, linear in ((layer._stacks.fc2, fc2), (layer._stacks.fc1, fc1)))
            found[(bias, backend)] = dict(
                out=_rel_diff(out, ref[0]), dx=_rel_diff(dx, ref[1]),
                dw=max(_rel_diff(grads[k], ref[2][k]) for k in ref[2]),
                grad_names=sorted(grads) == sorted(ref[2]), view=view or bias,
                fused=layer.last_plan is not None or backend == "reference",
                experts=type(layer.experts).__name__)
    # an activation only TE's forward computes (interleaved GLU): FC1 stays TE's linear
    from megatron_overlap.mcore.experts import te_fc1_is_grouped

    config = _config(1, world, moe_mlp_glu_interleave_size=4,
                     moe_shared_expert_intermediate_size=None)
    torch.manual_seed(1234)
    stock = spec(config=config)
    ref = _run(stock, x, grad)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"))(config=config)
    layer.load_state_dict(stock.state_dict())
    out, dx, grads = _run(layer, x, grad)
    found["interleaved"] = dict(
        out=_rel_diff(out, ref[0]), dx=_rel_diff(dx, ref[1]),
        dw=max(_rel_diff(grads[k], ref[2][k]) for k in ref[2]),
        grouped_fc1=te_fc1_is_grouped(layer.experts), grad_names=sorted(grads) == sorted(ref[2]),
        fused=True, experts=type(layer.experts).__name__)
    # recomputed activations are not fused: stock bits, one warning
    config = _config(1, world, recompute_granularity="selective", moe_grouped_gemm=True,
                     recompute_modules=["moe_act"], moe_shared_expert_intermediate_size=None)
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"))(config=config)
    with warnings.catch_warnings(record=True) as caught:
        # (the decision alone: Megatron's recompute reads the CUDA RNG state on a CPU)
        warnings.simplefilter("always")
        found["fallback_fuses"] = layer._path(x, None).fused or layer._path(x, None).fused
    found["fallback"] = [str(w.message) for w in caught if "megatron-overlap" in str(w.message)]
    found["fallback_dispatcher"] = type(layer.token_dispatcher).__name__  # (Megatron's own)
    ps.destroy_model_parallel()
    return found


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def te_runs(request):
    return run_ranks(request.param, _te_scenarios)


def test_te_grouped_experts_fuse_with_stock_outputs_and_gradients(te_runs):
    """FC1 a grouped GEMM over TE's weight0.. (TE's own linear where the activation is
    one only its forward computes), Megatron's activation; FC2 (and its bias x prob) the
    op's: stock's outputs and every gradient."""
    for rank, res in enumerate(te_runs):
        for key, r in res.items():
            if key in ("fallback", "fallback_fuses", "fallback_dispatcher"):
                continue
            assert r["experts"] == "TEGroupedMLP" and r["fused"] and r["grad_names"], (rank, key)
            assert max(r["out"], r["dx"], r["dw"]) < 1e-5, (rank, key, r)


def test_te_fc1_and_fc2_weights_reach_the_grouped_gemms_as_views_without_a_copy(te_runs):
    for res in te_runs:
        assert all(r["view"] for key, r in res.items() if isinstance(key, tuple))


def test_te_interleaved_glu_keeps_te_fc1_and_matches_stock(te_runs):
    for res in te_runs:
        assert not res["interleaved"]["grouped_fc1"]


def test_te_experts_with_recomputed_activations_run_stock_after_one_warning(te_runs):
    for res in te_runs:
        assert len(res["fallback"]) == 1 and "recomputed activations" in res["fallback"][0]
        assert not res["fallback_fuses"]
        assert res["fallback_dispatcher"] == "MoEAllGatherTokenDispatcher"


def test_te_spec_without_transformer_engine_is_a_clear_error_naming_the_extra():
    from megatron_overlap.mcore.models import model_config, model_spec
    from megatron_overlap.optional import te_available

    if te_available() is None:
        pytest.skip("Transformer Engine is importable here")
    config, _ = model_config("qwen", tiny=True, impl="te")
    assert config.transformer_impl == "transformer_engine" and config.moe_grouped_gemm
    with pytest.raises(RuntimeError, match=r"impl='te' needs Transformer Engine.*\[te\]"):
        model_spec(config)


def test_te_spec_refuses_experts_that_contradict_the_config():
    from megatron_overlap.mcore.models import model_config, model_spec

    config, _ = model_config("qwen", tiny=True, impl="te")
    with pytest.raises(ValueError, match="moe_grouped_gemm=False"):
        model_spec(config, experts="sequential")
    with pytest.raises(ValueError, match="impl must be one of"):
        model_config("qwen", tiny=True, impl="apex")
