"""OverlapMoELayer vs stock MoELayer on CPU ranks (gloo): same weights, same routing.

One spawned group of 4 ranks runs every layout (TP1EP1, TP2EP1, TP1EP2 with data-parallel
replicas, and TP2EP2), both experts modules, both CPU backends, so Megatron is imported
once per rank (several seconds each).
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

LAYOUTS = {"TP1EP1": (1, 1), "TP2EP1": (2, 1), "TP1EP2": (1, 2), "TP2EP2": (2, 2),
           "TP4EP1": (4, 1), "TP1EP4": (1, 4)}  # the last two: the paper's 4-GPU layouts
EXPERTS = ("sequential", "grouped")
BACKENDS = ("reference", "interpret")


def _config(tp, ep, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
               moe_router_topk=2, moe_ffn_hidden_size=16, ffn_hidden_size=16,
               moe_token_dispatcher_type="allgather", tensor_model_parallel_size=tp,
               expert_model_parallel_size=ep, sequence_parallel=tp > 1,
               use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
               add_bias_linear=False, params_dtype=torch.float32,
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_shared_expert_intermediate_size=24, moe_router_pre_softmax=True)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _moe_spec(experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_overlap.mcore.spec import with_grouped_experts

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp
    return with_grouped_experts(spec) if experts == "grouped" else spec


def _run(layer, x, grad):
    """Forward + backward; output, input grad and every parameter grad, detached."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def _rel_diff(a, b):
    """max |a - b| / max |b| (0 for empty tensors)."""
    if not b.numel():
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _layer_scenarios(rank, world):
    import warnings

    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps

    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    results = {}
    for name, (tp, ep) in LAYOUTS.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        config = _config(tp, ep)
        g = torch.Generator().manual_seed(100 + rank // tp)  # same tokens across a TP group
        x = torch.randn(12 // tp, 2, 32, generator=g)  # [S/TP, B, H], sequence parallel
        grad = torch.randn(12 // tp, 2, 32, generator=g)
        for experts in EXPERTS:
            spec = _moe_spec(experts)
            torch.manual_seed(1234)
            stock = spec(config=config)
            ref = _run(stock, x, grad)
            for backend in BACKENDS:
                torch.manual_seed(1234)
                layer = with_overlap_moe(spec, OverlapConfig(backend=backend))(config=config)
                assert isinstance(layer, OverlapMoELayer)
                same_init = all(torch.equal(a, b) for a, b in
                                zip(stock.state_dict().values(), layer.state_dict().values())
                                if isinstance(a, torch.Tensor))
                with warnings.catch_warnings():
                    # the supported path never warns
                    warnings.filterwarnings("error", message="megatron-overlap")
                    out, dx, grads = _run(layer, x, grad)
                inference = 0.0
                if backend == "interpret":
                    # inference: the Triton SwiGLU, the deferred postprocess (padded under EP)
                    layer.eval(), stock.eval()
                    with torch.no_grad():
                        inference = _rel_diff(layer(x)[0], stock(x)[0])
                if experts == "grouped" and backend == "interpret":
                    # the gathered tokens of this TP x EP group: 12 / TP x 2 per rank
                    results[(name, "fusion")] = _fusion_sizes(layer, tp, ep)
                    results[(name, "postprocess")] = _postprocess_equal(layer, stock, x)
                    results[(name, "redo")] = _redo_equal(layer, x)
                    results[(name, "fc1 first")] = _fc1_before_the_counts(layer, stock, x)
                    results[(name, "device counts")] = _counts_on_device(layer, x)
                    results[(name, "captured")] = _captured(layer, stock, x)
                results[(name, experts, backend)] = dict(
                    same_init=same_init, out=_rel_diff(out, ref[0]), dx=_rel_diff(dx, ref[1]),
                    dw=max(_rel_diff(grads[k], ref[2][k]) for k in ref[2]),
                    grad_names=sorted(grads) == sorted(ref[2]),
                    plan=None if layer.last_plan is None else layer.last_plan.source,
                    inference=inference)
        if name in ("TP1EP1", "TP2EP2"):
            results[(name, "gated")] = _gated_shared_case(tp, ep, x, grad)
        if name == "TP2EP2":
            results["bf16"] = _bf16_case(tp, ep, x, grad)
        if name in ("TP1EP1", "TP1EP2"):  # Megatron has expert biases only without expert TP
            results[(name, "biases")] = _biased_case(tp, ep, x, grad)
        if name == "TP1EP2":
            results["dispatchers"] = _dispatcher_classes(config, x, grad)
            results["toggle"] = _toggle_and_fallback(config, x, grad)
            results["log"] = _decision_log(config, x)
    ps.destroy_model_parallel()
    return results


def _fusion_sizes(layer, tp: int, ep: int):
    """(the layer's fuse-or-not answer, `fusion_decision`'s for the sizes it should ask
    about) under H200's step costs, for the gathered tokens of a call."""
    import dataclasses

    from megatron_overlap.ops import fusion_decision

    config, layer.overlap_config = layer.overlap_config, dataclasses.replace(
        layer.overlap_config, preset="h200")
    layer._fusion = {}  # (answers cached under the test's own config)
    tokens = 12 // tp * 2 * tp * ep
    try:
        got = layer._fusion_for(torch.empty(tokens, 32), False)  # (a training call)
        want = fusion_decision(num_tokens=tokens, hidden=32, ffn=16 // tp, topk=2,
                               local_experts=4 // ep, experts=4, dtype=torch.float32,
                               device=torch.device("cpu"),
                               group=layer.token_dispatcher.tp_ep_group,
                               config=layer.overlap_config)
    finally:
        layer.overlap_config, layer._fusion = config, {}
    return got, want


def _postprocess_equal(layer, stock, x):
    """The installed dispatcher's postprocesses against Megatron's `dispatch_postprocess`
    (the stock layer's dispatcher's, and the installed one's, which it inherits) on the
    same dispatched tokens: the same rows, permutation, probabilities and counts,
    bitwise; `deferred_postprocess` exact where every expert is local, padded to its
    bound (inference) everywhere: its first rows, once `settle` trims them, Megatron's."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    disp = layer.token_dispatcher
    topk = layer.config.moe_router_topk
    with torch.no_grad():
        probs, routing_map = layer.route(x)
        hidden, probs = layer.preprocess(x, probs, routing_map)
        hidden, probs = layer.dispatch(hidden, probs)
        routing = disp.routing_map
        theirs = disp.dispatch_postprocess(hidden, probs)
        their_perm = disp.reversed_local_input_permutation_mapping
        megatrons = stock.token_dispatcher
        megatrons.routing_map = routing
        same = (type(megatrons) is MoEAllGatherTokenDispatcher
                and all(torch.equal(a, b) for a, b in zip(
                    megatrons.dispatch_postprocess(hidden, probs), theirs))
                and torch.equal(megatrons.reversed_local_input_permutation_mapping, their_perm))
        disp.routing_map = routing
        ours = disp.single_sync_postprocess(hidden, probs)
        same = (same and all(torch.equal(a, b) for a, b in zip(ours, theirs))
                and torch.equal(disp.reversed_local_input_permutation_mapping, their_perm)
                and disp.routing_map is None and ours[0].shape[0] > 0)
        for pad in (False, True):
            disp.routing_map = routing
            late = disp.deferred_postprocess(hidden, probs, topk, pad=pad)
            if late is None:  # experts on other ranks, no padding: the rows need the counts
                same = same and not pad and disp.ep_size > 1
                disp.routing_map = None
                continue
            bound = late.permuted.shape[0]
            settled = disp.settle(late)
            late_out = (settled.rows, settled.counts, settled.probs)
            same = (same and all(torch.equal(a, b) for a, b in zip(late_out, theirs))
                    and torch.equal(settled.token_index, their_perm)
                    and torch.equal(disp.reversed_local_input_permutation_mapping, their_perm)
                    and torch.equal(disp.local_probs, theirs[2])
                    and late.routing_map is routing and disp.routing_map is None
                    and late.padded == pad
                    and bound == hidden.shape[0] * min(topk, disp.num_local_experts))
        return same


def _dispatcher_classes(config, x, grad):
    """Which dispatcher each layer holds: the overlap's where the fused path is supported
    (built as Megatron built its own: the same attributes, groups, config), Megatron's
    own object of Megatron's exact class where it is not (another dispatcher, experts
    the op cannot take), whose forward then gives the stock layer's bits."""
    import dataclasses
    import functools
    import warnings

    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)

    from megatron_overlap.mcore.dispatch import OverlapAllGatherDispatcher
    from megatron_overlap.mcore.experts import GroupedGemmExperts
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    class WrappedExperts(torch.nn.Module):  # experts the op does not know
        def __init__(self, n, config, pg_collection=None, name=None):
            super().__init__()
            self.inner = GroupedGemmExperts(n, config, pg_collection=pg_collection)

        def forward(self, *args):
            return self.inner(*args)

    spec = _moe_spec("grouped")
    overlap = OverlapConfig(backend="interpret")
    stock, layer = spec(config=config), with_overlap_moe(spec, overlap)(config=config)
    a, b = vars(stock.token_dispatcher), vars(layer.token_dispatcher)
    built_alike = a.keys() == b.keys() and all(a[k] is b[k] or a[k] == b[k] for k in a)
    alltoall = with_overlap_moe(spec, overlap)(
        config=dataclasses.replace(config, moe_token_dispatcher_type="alltoall"))
    wrapped = functools.partial(spec.func, *spec.args, **dict(
        spec.keywords, submodules=dataclasses.replace(spec.keywords["submodules"],
                                                      experts=WrappedExperts)))
    torch.manual_seed(1234)
    ref = _run(wrapped(config=config), x, grad)
    torch.manual_seed(1234)
    unfused = with_overlap_moe(wrapped, overlap)(config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its one "not supported" warning)
        out = _run(unfused, x, grad)
    return dict(
        installed=type(layer.token_dispatcher) is OverlapAllGatherDispatcher,
        built_alike=built_alike, groups=b["tp_ep_group"] is a["tp_ep_group"],
        alltoall=type(alltoall.token_dispatcher) is MoEAlltoAllTokenDispatcher,
        unfused=type(unfused.token_dispatcher) is MoEAllGatherTokenDispatcher,
        unfused_equal=all(torch.equal(g, r) for g, r in zip(out[:2], ref[:2])))


def _redo_equal(layer, x):
    """Were the rows fewer than M x top-k (a router dropping tokens), with host counts: in
    inference the deferred postprocess's padding rows are trimmed; where they may not be
    (a gradient flows) the layer redoes it with the counts. Both give the exact path's
    output. With the counts kept on the device (the default where every expert is
    local) the op sees counts short of the rows: a clear error, not a wrong output."""
    import megatron_overlap.mcore.layer as layer_module
    from megatron_overlap.mcore.policy import LayerPolicy

    real, policy = layer_module.deferred_postprocess, layer.policy
    short = lambda d, h, p, k, pad=False, **kw: real(d, h, p, k + 1, pad=pad, **kw)  # noqa: E731
    with torch.no_grad():
        want = layer(x)[0]
        got, error = {}, None
        layer.policy = LayerPolicy(host_counts=True)
        try:
            for pad in (True, False):
                layer_module.deferred_postprocess = (
                    lambda *a, pad=pad, **kw: short(*a, **dict(kw, pad=pad)))
                got[pad] = layer(x)[0]
            layer.policy = policy
            layer_module.deferred_postprocess = short
            try:
                layer(x)
            except ValueError as err:
                error = str(err)
        finally:
            layer_module.deferred_postprocess = real
            layer.policy = policy
    local = layer.num_local_experts == layer.config.num_moe_experts
    return (torch.equal(got[True], want) and torch.equal(got[False], want)
            and (error is not None and "sums to" in error) == local)


def _counts_on_device(layer, x):
    """In inference the layer never waits for the host counts: the op gets them as the
    device tensor (`last_rows`), with the bits of the path that waits for them
    (`host_counts=True`); under EP with the rows padded to their bound."""
    from megatron_overlap.mcore import dispatch
    from megatron_overlap.mcore.policy import LayerPolicy

    real, policy, waits = dispatch.Deferred.tokens_per_expert, layer.policy, []

    def counted(self):
        waits.append(1)
        return real(self)

    dispatch.Deferred.tokens_per_expert = counted
    try:
        with torch.no_grad():
            kept = layer(x)[0]
            kept_waits, kept_rows = len(waits), layer.last_rows
            layer.policy = LayerPolicy(host_counts=True)
            host = layer(x)[0]
    finally:
        dispatch.Deferred.tokens_per_expert = real
        layer.policy = policy
    return dict(equal=torch.equal(kept, host), waits=kept_waits,
                host_waits=len(waits) - kept_waits, rows=int(sum(kept_rows)))


def _captured(layer, stock, x):
    """An inference forward captured into a CUDA graph (faked: CPU; the op itself runs
    eagerly): in inference the layer fuses at any size (the model's stock-path answer
    here prices host time, which a replay does not have), with the bits of the
    eager fused call (where it refuses: the stock path's bits)."""
    import dataclasses

    import megatron_overlap.mcore.layer as layer_module
    from megatron_overlap.mcore.convert import fused_at_every_size

    config, policy, real = layer.overlap_config, layer.policy, layer_module.capturing
    noted = layer.last_plan, layer.last_rows, layer._last_key  # (what later checks read)
    with torch.no_grad():
        fused, want_stock = layer(x)[0], stock(x)[0]
        # H200's step costs: at these sizes the model predicts the stock path faster
        small = dataclasses.replace(config, preset="h200")
        layer.overlap_config, layer._fusion = small, {}
        below = layer(x)[0], layer.last_path.fused  # eager: the model says stock
        layer.overlap_enabled = False
        with fused_at_every_size(layer):  # a capture's eager reference
            everywhere = layer(x)[0], layer.last_path.fused
        restored = (layer.overlap_enabled is False and layer.overlap_config is small
                    and layer.policy is policy)
        layer.overlap_enabled = True
        layer_module.capturing = lambda t: True
        try:
            got = layer(x)[0]
        finally:
            layer_module.capturing = real
            layer.overlap_config, layer._fusion = config, {}
    fused_now = layer.last_path.fused
    layer.last_plan, layer.last_rows, layer._last_key = noted
    return dict(fused=fused_now, eager_below_fused=below[1], restored=restored,
                everywhere_fused=everywhere[1], everywhere_equal=torch.equal(everywhere[0], fused),
                equal=torch.equal(got, fused if fused_now else want_stock),
                warned=sorted(k for k in layer_module._warned if k.startswith("capture")))


def _fc1_before_the_counts(layer, stock, x):
    """Inference with FC1 queued before the host has the counts, as on a GPU
    (torch._grouped_mm on device offsets; it runs on CPU too): under EP on the padded
    rows, whose outputs the activation skips and the layer trims. Against stock."""
    import megatron_overlap.mcore.experts as experts_module
    import megatron_overlap.mcore.layer as layer_module
    from megatron_overlap.mcore.policy import LayerPolicy

    real, real_deferred = experts_module._grouped_mm_ok, layer_module.deferred_postprocess
    experts_module._grouped_mm_ok = lambda t: hasattr(torch, "_grouped_mm")
    policy = layer.policy  # (the redo below needs the host counts)
    layer.policy = LayerPolicy(host_counts=True)
    try:
        with torch.no_grad():
            want = stock(x)[0]
            first = _rel_diff(layer(x)[0], want)
            # a bound below the rows (a router breaking its top-k): FC1 was queued on
            # offsets clamped to the bound, then the layer redoes it with the counts
            layer_module.deferred_postprocess = (
                lambda d, h, p, k, **kw: real_deferred(d, h, p, k - 1, **kw))
            return max(first, _rel_diff(layer(x)[0], want))
    finally:
        experts_module._grouped_mm_ok = real
        layer_module.deferred_postprocess = real_deferred
        layer.policy = policy


def _bf16_case(tp, ep, x, grad):
    """bf16 parameters and activations: the overlapped op reduces in fp32 like the stock
    reduce-scatter (which runs in the probs' fp32), so the two agree to bf16 rounding."""
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _config(tp, ep, params_dtype=torch.bfloat16, bf16=True)
    spec = _moe_spec("grouped")
    x, grad = x.bfloat16(), grad.bfloat16()
    torch.manual_seed(1234)
    ref = _run(spec(config=config), x, grad)
    torch.manual_seed(1234)
    out = _run(with_overlap_moe(spec, OverlapConfig(backend="interpret"))(config=config), x, grad)
    return dict(dtype=str(out[0].dtype), out=_rel_diff(out[0], ref[0]),
                dx=_rel_diff(out[1], ref[1]))


def _gated_shared_case(tp, ep, x, grad):
    """A gated shared expert (Qwen's): in inference the overlapped layer adds it with one
    kernel (`add_gated_shared_`), close to stock; below the size threshold, or with a
    gradient, the stock path's bits."""
    import megatron_overlap.mcore.shared_gate as shared_gate
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _config(tp, ep, moe_shared_expert_gate=True)
    spec = _moe_spec("grouped")
    torch.manual_seed(1234)
    stock = spec(config=config)
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="interpret"))(config=config)
    torch.manual_seed(1234)
    # (H200's step costs: at these sizes the model predicts the stock path faster)
    small = with_overlap_moe(spec, OverlapConfig(backend="interpret",
                                                 preset="h200"))(config=config)
    calls = []
    real = shared_gate.add_gated_shared_
    shared_gate.add_gated_shared_ = lambda *a: calls.append(1) or real(*a)
    try:
        for m in (stock, layer, small):
            m.eval()
        with torch.no_grad():
            want = stock(x)[0]
            fused = layer(x)[0]
            fused_calls = len(calls)
            below = small(x)[0]
            whole = layer._fuses_shared_gate(x)
            layer.fwd_execution_map = "route"  # a forward split into steps (Megatron's
            split = layer._fuses_shared_gate(x)  # CUDA-graph and 1F1B-overlap schedules)
            layer.fwd_execution_map = ["route", "expert_compute", "postprocess"]
            # a stale stash (a call that failed after the shared expert) never replaces
            # the shared output a later postprocess is given, and is dropped
            layer.shared_experts_compute(x)
            routed, given = torch.randn_like(x), torch.randn_like(x)
            stale_ok = (torch.equal(layer.postprocess(routed, given), routed + given)
                        and layer._in_flight is None)
            layer.train()  # a training step's forward without gradients (a recompute's)
            recompute = layer._fuses_shared_gate(x)
        trained, ref = _run(layer, x, grad), _run(stock.train(), x, grad)
    finally:
        shared_gate.add_gated_shared_ = real
    return dict(inference=_rel_diff(fused, want), fused_calls=fused_calls,
                below_equal=torch.equal(below, want), calls_after=len(calls) - fused_calls,
                trained=max(_rel_diff(a, b) for a, b in zip(trained[:2], ref[:2])),
                gate_grad=_rel_diff(trained[2]["shared_experts.gate_weight"],
                                    ref[2]["shared_experts.gate_weight"]),
                gate_restored=layer.shared_experts.use_shared_expert_gate,
                whole=whole, split=split, recompute=recompute, stale_ok=stale_ok)


def _decision_log(config, x):
    """INFO lines of a layer over three launches: same decision twice, then a new C."""
    import logging

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    lines = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("megatron_overlap.mcore")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        layer = with_overlap_moe(_moe_spec("grouped"), OverlapConfig(backend="interpret"))(
            config=config)
        layer.set_layer_number(3)
        with torch.no_grad():
            layer(x)
            layer(x)
            layer.overlap_config = OverlapConfig(backend="interpret", comm_ctas=5)
            layer(x)
    finally:
        log.removeHandler(handler)
    return dict(lines=lines, decisions=layer.decisions)


def _twice_with_warnings(layer, x, grad):
    """The first of two runs, and the package's warnings over both."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _run(layer, x, grad)
        _run(layer, x, grad)
    return first, [str(w.message) for w in caught if "megatron-overlap" in str(w.message)]


def _biased_case(tp, ep, x, grad):
    """add_bias_linear (Megatron-LM's default): FC1 and FC2 biases, random, fused against
    stock for both experts modules and backends. Stock SequentialMLP with local linears
    cannot take a gradient with biases in megatron-core 0.19 (MLP adds FC2's bias in place
    into a view of a custom Function's output), so there the forward is compared without
    gradients and ours must still give every bias a gradient."""
    import warnings

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _config(tp, ep, add_bias_linear=True, moe_shared_expert_intermediate_size=None)
    found = {}
    for experts in EXPERTS:
        spec = _moe_spec(experts)
        torch.manual_seed(1234)
        stock = spec(config=config)
        with torch.no_grad():
            for name, p in stock.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn_like(p))
        if experts == "sequential":
            with torch.no_grad():
                ref = (stock(x)[0], None, None)
        else:
            ref = _run(stock, x, grad)
        for backend in BACKENDS:
            layer = with_overlap_moe(spec, OverlapConfig(backend=backend))(config=config)
            layer.load_state_dict(stock.state_dict())
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="megatron-overlap")
                out, dx, grads = _run(layer, x, grad)
            r = found[(experts, backend)] = dict(
                out=_rel_diff(out, ref[0]), dx=0.0, dw=0.0,
                bias_grads=sorted(k for k, g in grads.items() if "bias" in k and g.abs().max() > 0),
                fused=layer.last_plan is not None or backend == "reference")
            if ref[1] is not None:
                r.update(dx=_rel_diff(dx, ref[1]),
                         dw=max(_rel_diff(grads[k], ref[2][k]) for k in ref[2]),
                         grad_names=sorted(grads) == sorted(ref[2]))
    return found


def _toggle_and_fallback(config, x, grad):
    """overlap_enabled=False is the stock path (an unsupported config: test_mcore_te_experts)."""
    from megatron_overlap.mcore.convert import set_overlap_enabled
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig
    from megatron_overlap.mcore.policy import LayerPolicy

    spec = _moe_spec("sequential")
    torch.manual_seed(1234)
    stock = spec(config=config)
    ref = _run(stock, x, grad)
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"))(config=config)
    toggled = set_overlap_enabled(layer, False)
    off = _run(layer, x, grad)
    # the planner's fuse-or-not: H200's step costs say stock at these sizes; "always"
    # fuses; without step costs (the interpreter's device, no preset) it fuses
    small = {}
    for key, extra, policy in (("model: stock", dict(preset="h200"), None),
                               ("always", dict(preset="h200"), LayerPolicy(fuse="always")),
                               ("no step costs", {}, None)):
        torch.manual_seed(1234)
        layer_t = with_overlap_moe(spec, OverlapConfig(backend="interpret", **extra), policy)(
            config=config)
        run_t = _run(layer_t, x, grad)
        small[key] = dict(
            equal=torch.equal(run_t[0], ref[0]) and torch.equal(run_t[1], ref[1]),
            plan=None if layer_t.last_plan is None else layer_t.last_plan.source,
            fuse=None if layer_t.last_fusion is None else layer_t.last_fusion.fuse)
    # a call captured into a CUDA graph (faked here: CPU) runs the stock path, one warning
    import megatron_overlap.mcore.layer as layer_module

    real_capturing, layer_module.capturing = layer_module.capturing, lambda t: True
    try:
        torch.manual_seed(1234)
        layer_c = with_overlap_moe(spec, OverlapConfig(backend="interpret"))(config=config)
        cap, cap_warnings = _twice_with_warnings(layer_c, x, grad)
    finally:
        layer_module.capturing = real_capturing
    captured = dict(equal=torch.equal(cap[0], ref[0]) and torch.equal(cap[1], ref[1]),
                    plan=layer_c.last_plan, warnings=cap_warnings)
    return dict(toggled=toggled, captured=captured,
                off_equal=torch.equal(off[0], ref[0]) and torch.equal(off[1], ref[1]),
                fusion=small)


@pytest.fixture(scope="module")
def layer_runs():
    return run_ranks(4, _layer_scenarios)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_layer_matches_stock_forward_and_gradients(layer_runs, layout, experts, backend):
    for rank, res in enumerate(layer_runs):
        r = res[(layout, experts, backend)]
        assert r["same_init"], (rank, r)
        assert r["grad_names"], (rank, r)
        assert r["out"] < 1e-5 and r["dx"] < 1e-5 and r["dw"] < 1e-5, (rank, r)  # fp32


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_single_sync_dispatch_gives_megatrons_rows_and_inference_matches_stock(layer_runs,
                                                                             layout):
    for rank, res in enumerate(layer_runs):
        assert res[(layout, "postprocess")] and res[(layout, "redo")], rank
        assert res[(layout, "grouped", "interpret")]["inference"] < 1e-5, rank
        assert res[(layout, "sequential", "interpret")]["inference"] < 1e-5, rank
        assert res[(layout, "fc1 first")] < 1e-5, rank


def test_interpret_backend_plans_every_launch_and_reference_does_not(layer_runs):
    for res in layer_runs:
        for key, r in res.items():
            if not isinstance(key, tuple) or key[1] in ("postprocess", "redo", "gated",
                                                        "fc1 first", "fusion",
                                                        "device counts", "captured", "biases"):
                continue
            layout, experts, backend = key
            assert r["plan"] == ("model" if backend == "interpret" else None), (layout, experts, r)


@pytest.mark.parametrize("layout", ["TP1EP1", "TP2EP2"])
def test_gated_shared_expert_joins_in_one_pass_in_inference_and_stock_elsewhere(layer_runs,
                                                                               layout):
    for rank, res in enumerate(layer_runs):
        r = res[(layout, "gated")]
        assert r["fused_calls"] == 1 and r["inference"] < 1e-5, (rank, r)  # fp32
        assert r["below_equal"] and r["calls_after"] == 0, (rank, r)
        assert r["trained"] < 1e-5 and r["gate_grad"] < 1e-5 and r["gate_restored"], (rank, r)
        assert r["whole"] and not r["split"] and not r["recompute"], (rank, r)
        assert r["stale_ok"], (rank, r)


def test_bf16_layer_matches_stock_to_bf16_rounding(layer_runs):
    for rank, res in enumerate(layer_runs):
        r = res["bf16"]
        assert r["dtype"] == "torch.bfloat16" and r["out"] < 2e-2 and r["dx"] < 2e-2, (rank, r)


def test_each_layer_logs_its_first_decision_and_each_change_at_info(layer_runs):
    for res in layer_runs:
        lines = res["log"]["lines"]
        assert res["log"]["decisions"] == 2 and len(lines) == 2, lines
        assert all(line.startswith("moe-overlap layer 3: C=") for line in lines)
        assert "C=5 " in lines[1] and "M=48 N=32 K=16 D=2 E=2" in lines[1], lines


def test_layer_installs_its_dispatcher_only_where_it_fuses_and_as_megatron_built_it(
        layer_runs):
    for rank, res in enumerate(layer_runs):
        r = res["dispatchers"]
        assert r["installed"] and r["built_alike"] and r["groups"], (rank, r)
        assert r["alltoall"] and r["unfused"] and r["unfused_equal"], (rank, r)


def test_overlap_switched_off_is_the_stock_path(layer_runs):
    for res in layer_runs:
        assert res["toggle"]["toggled"] == 1 and res["toggle"]["off_equal"]


@pytest.mark.parametrize("layout", ["TP1EP1", "TP1EP2"])
def test_expert_biases_fuse_with_stock_outputs_and_gradients(layer_runs, layout):
    """FC2's bias enters as bias[e] x prob[row] (TEGroupedMLP / MLP's order), folded into
    GEMM2 as one more column; FC1's before the activation. fp32: near-exact."""
    biased = {}  # (a rank whose experts got no rows under EP has no bias gradient)
    for rank, res in enumerate(layer_runs):
        for key, r in res[(layout, "biases")].items():
            assert r.get("grad_names", True) and r["fused"], (rank, key, r)
            assert max(r["out"], r["dx"], r["dw"]) < 1e-5, (rank, key, r)
            biased[key] = max(biased.get(key, 0), len(r["bias_grads"]) - 1)  # (router's)
    assert biased and min(biased.values()) >= 2, biased  # FC1's and FC2's, somewhere


def test_calls_captured_into_a_cuda_graph_run_the_stock_path_after_one_warning(layer_runs):
    for res in layer_runs:
        c = res["toggle"]["captured"]
        assert c["equal"] and c["plan"] is None
        assert len(c["warnings"]) == 1 and "CUDA graph" in c["warnings"][0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layer_never_waits_for_the_counts_in_inference(layer_runs, layout):
    """Every expert local: the rows are M x top-k; under EP: padded to their bound, which
    the op skips (`expected_rows`). Same bits as waiting for the counts."""
    tp, ep = LAYOUTS[layout]
    for rank, res in enumerate(layer_runs):
        r = res[(layout, "device counts")]
        assert r["equal"] and r["host_waits"] == 1, (rank, r)  # host_counts=True waits
        assert r["waits"] == 0, (rank, r)
        if ep == 1:  # every token's top-2 rows: 24 gathered tokens x 2
            assert r["rows"] == 48, (rank, r)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_captured_inference_forward_fuses_at_any_size_in_every_layout(layer_runs, layout):
    """(Under EP through the padded rows; a bound too loose for them: `rows_bound`.)"""
    for rank, res in enumerate(layer_runs):
        r = res[(layout, "captured")]
        assert r["equal"] and not r["eager_below_fused"] and r["fused"], (rank, r)
        # what `fused_at_every_size` gives a capture to check against: that same call
        assert r["everywhere_fused"] and r["everywhere_equal"] and r["restored"], (rank, r)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_layer_asks_the_planner_with_one_ranks_share_of_the_expert_work(layer_runs,
                                                                             layout):
    """The layer's fuse-or-not question carries the gathered tokens (12 / TP x 2 per rank
    over TP x EP), the FFN TP splits and the experts EP splits: its answer equals
    `fusion_decision`'s for those sizes (hidden 32, top-k 2, 4 experts)."""
    for res in layer_runs:
        got, want = res[(layout, "fusion")]
        assert got == want and not got.fuse, (layout, got, want)


def test_layers_the_model_prices_slower_fused_run_the_stock_path_bit_for_bit(layer_runs):
    for res in layer_runs:
        t = res["toggle"]["fusion"]
        assert t["model: stock"] == {"equal": True, "plan": None, "fuse": False}
        assert t["always"]["plan"] == "model" and t["always"]["fuse"] is None
        assert t["no step costs"]["plan"] == "model" and t["no step costs"]["fuse"] is True
