"""OverlapMoELayer decides each forward call's path once (`CallPath`) and hands nothing of
one call to the next (CPU, one rank, the Triton interpreter)."""

from dist_harness import run_ranks
from test_mcore_layer import _config, _moe_spec


def _paths(rank, world):
    import mcore_shims
    import torch

    mcore_shims.install()
    from megatron.core import parallel_state as ps

    import megatron_overlap.mcore.layer as layer_module
    from megatron_overlap.mcore import LayerPolicy, with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    layer = with_overlap_moe(_moe_spec("grouped"), OverlapConfig(backend="interpret"),
                             LayerPolicy(fuse="always"))(config=_config(1, 1))
    asked = {"in_inference": 0, "needs_host_counts": 0}
    for name in asked:
        real = getattr(layer_module, name)

        def counted(*args, name=name, real=real):
            asked[name] += 1
            return real(*args)
        setattr(layer_module, name, counted)
    x = torch.randn(8, 2, 32)
    found = {}
    for mode in ("train", "eval"):
        getattr(layer, mode)()
        for key in asked:
            asked[key] = 0
        with torch.set_grad_enabled(mode == "train"):
            layer(x)
        found[mode] = dict(asked, path=layer.last_path, in_flight=layer._in_flight)
    ps.destroy_model_parallel()
    return found


def test_each_call_asks_its_path_once_and_leaves_nothing_for_the_next():
    found = run_ranks(1, _paths, timeout=300)[0]
    for mode, inference in (("train", False), ("eval", True)):
        got = found[mode]
        assert got["in_inference"] == 1 and got["needs_host_counts"] == 1, (mode, got)
        assert got["path"].fused and got["path"].inference is inference
        assert got["in_flight"] is None  # (the call's hand-over is gone when it ends)
