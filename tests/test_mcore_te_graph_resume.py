"""OverlapMoELayer resumed after Megatron-Core 0.19's TE CUDA-graph partial capture
(`cuda_graph_impl="transformer_engine"`, `cuda_graph_modules=[moe_router, moe_preprocess]`),
in training, on CPU ranks (gloo). TE and CUDA are absent, so no graph is captured; the
graph part is emulated by what it runs (MoELayer.forward's custom_forward: shared expert,
router, preprocess; outside a capture, with the store empty, Megatron's decorators run the
original steps) and returns (Megatron's own `MoECudaGraphPartialCaptureSignal.
get_early_return_outputs`), each output copied as a replay gives its static buffers, with
gradients to x through the copies as through the graph's backward. The rest is
`TransformerLayer._te_cuda_graph_replay_impl`'s: dispatcher attributes set, the
`cudagraph_tensor_store` set, `layer(hidden_states_2d)`, the store cleared.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

LAYOUTS = {"TP1EP1": (1, 1), "TP1EP2": (1, 2)}  # every expert local; one sync (EP)


def _replayed(layer, x):
    """The graph's outputs (custom_forward up to preprocess, in its order), then
    _te_cuda_graph_replay_impl after the graph (moe_router + moe_preprocess)."""
    import functools

    from megatron.core.transformer.moe.moe_utils import MoECudaGraphPartialCaptureSignal

    c, disp, store = layer.config, layer.token_dispatcher, layer.cudagraph_tensor_store
    assert store.is_empty()
    shared = layer.shared_experts_compute(x)
    probs, routing_map = layer.route(x)
    hidden, probs = layer.preprocess(x, probs, routing_map)
    outputs = [t.clone() for t in MoECudaGraphPartialCaptureSignal(
        layer, "preprocess", hidden_states=hidden, probs=probs).get_early_return_outputs(
        x, shared)]
    shared = None  # (the replay's own, from the graph's outputs)
    if c.moe_shared_expert_intermediate_size is not None and not c.moe_shared_expert_overlap:
        shared = outputs.pop()
    (hidden, probs), attrs = outputs[:2], outputs[2:]
    assert disp.valid_cudagraph_attrs == ["routing_map"] and len(attrs) == 1  # (allgather)
    disp.routing_map = None  # (a replay's comes from the graph's outputs only)
    for name, value in zip(disp.valid_cudagraph_attrs, attrs):
        *path, last = name.split(".")
        setattr(functools.reduce(getattr, path, disp), last, value)
    store.set(hidden_states=hidden, probs=probs, routing_map=None, shared_expert_output=shared)
    try:
        return layer(hidden)
    finally:
        store.clear()


class _Resumed:  # the layer, called through the emulated graph and replay (for _run)

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return _replayed(self.layer, x)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def _compare(a, b):
    """(bitwise equal, max _rel_diff) over output, input and weight gradients."""
    from test_mcore_layer import _rel_diff

    if a[2].keys() != b[2].keys():
        return False, 1.0
    pairs = [(a[0], b[0]), (a[1], b[1])] + [(a[2][k], b[2][k]) for k in b[2]]
    return all(torch.equal(u, v) for u, v in pairs), max(_rel_diff(u, v) for u, v in pairs)


def _layout(tp, ep, rank, gate):
    import dataclasses
    import warnings

    from megatron.core.transformer.enums import CudaGraphModule
    from test_mcore_layer import _config, _moe_spec, _run

    from megatron_overlap.mcore.policy import LayerPolicy
    from megatron_overlap.mcore.shared_gate import gate_joins
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    g = torch.Generator().manual_seed(100 + rank)
    x, grad = torch.randn(12, 2, 32, generator=g), torch.randn(12, 2, 32, generator=g)
    config = dataclasses.replace(_config(tp, ep, moe_shared_expert_gate=gate))
    config.cuda_graph_impl = "transformer_engine"  # (set past TransformerConfig's TE checks)
    config.cuda_graph_modules = [CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
    torch.manual_seed(1234)
    layer = with_overlap_moe(_moe_spec("grouped"), OverlapConfig(backend="interpret"),
                             LayerPolicy(fuse="always"))(config=config).train()
    joins, ran, real_joins = [], [], layer._fuses_shared_gate
    layer._fuses_shared_gate = lambda h: joins.append(real_joins(h)) or joins[-1]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="megatron-overlap")  # nothing refused
        ordinary = _run(layer, x, grad)
        layer.last_plan = layer.last_path = None
        hooks = [m.register_forward_hook(lambda *_, n=n: ran.append(n))
                 for n, m in (("router", layer.router), ("shared", layer.shared_experts))]
        resumed = _run(_Resumed(layer), x, grad)
        [h.remove() for h in hooks]
    res = dict(fused=layer.last_plan is not None and layer.last_path.fused, ran=ran,
               joins=list(joins), store_empty=layer.cudagraph_tensor_store.is_empty(),
               gate_grad="shared_experts.gate_weight" in resumed[2])
    layer.overlap_enabled = False
    stock_resumed = _run(_Resumed(layer), x, grad)
    res.update(vs_ordinary=_compare(resumed, ordinary), vs_stock=_compare(resumed, stock_resumed),
               stock=_compare(stock_resumed, _run(layer, x, grad)))
    layer.overlap_enabled = True
    layer.eval()  # inference, where TE graphs never replay: the gate joins; under
    res["eval_joins"] = {}  # Megatron's local graphs it does not
    with torch.no_grad():
        for impl in ("transformer_engine", "none", "local"):
            layer.config.cuda_graph_impl = impl
            res["eval_joins"][impl] = gate_joins(layer, x)
    return res


def _scenarios(rank, world):
    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps

    results = {}
    for name, (tp, ep) in LAYOUTS.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        for gate in (False, True):
            results[(name, gate)] = _layout(tp, ep, rank, gate)
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def resume_runs():
    return run_ranks(2, _scenarios)


def _resumed_alike(r, rank):
    """Fused on the resumed call, router and shared expert run once (in the graph part,
    shared first), its bits those of the ordinary call, the stock layer's to 1e-5 (fp32,
    as test_mcore_layer), and the stock layer's own resumed call bitwise its ordinary."""
    assert r["fused"] and r["store_empty"] and r["ran"] == ["shared", "router"], (rank, r)
    assert r["vs_ordinary"][0], (rank, r)
    assert r["vs_stock"][1] < 1e-5 and r["stock"][0], (rank, r)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_path_resumed_from_te_partial_graph_gives_its_ordinary_forwards_bits(
        resume_runs, layout):
    """Output, input and every weight gradient are bitwise the ordinary call's: the same
    kernels on the same operands, the graph part only moves where route / preprocess run."""
    for rank, res in enumerate(resume_runs):
        _resumed_alike(res[(layout, False)], rank)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gated_shared_expert_resumes_with_stored_output_and_joins_only_in_eval(
        resume_runs, layout):
    """In training the layer leaves the gate to Megatron's module (inside the graph), and
    the graph's stored, gated shared output gives the ordinary call's bits, the gate
    weight's gradient included; in eval, where TE graphs never replay, the gate joins as
    without graphs, and under Megatron's local graphs it does not."""
    for rank, res in enumerate(resume_runs):
        r = res[(layout, True)]
        _resumed_alike(r, rank)
        assert r["gate_grad"] and r["joins"] == [False] * 3, (rank, r)  # ordinary, graph, resumed
        assert r["eval_joins"] == {"transformer_engine": True, "none": True, "local": False}, \
            (rank, r)
