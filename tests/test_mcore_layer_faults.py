"""A fault inside a training step of OverlapMoELayer: an exception on every rank of the
group within the op's bound (no hang), and the layer's next step correct with no reset
call (the op's recovery, `kernels/flags.py`; README "Faults between ranks").

Two gloo ranks, TP1EP2 (the op reduce-scatters over both), the interpreter backend, the
fused path at every size. The fault: rank 0's op refuses its call before launching (an
invalid C), as a bad input on one rank would; rank 1's op then sees its peer's call marked
failed, does not pair with it and raises too. Megatron's own collectives before the op (the dispatcher's
all-gather) run on both ranks, as they do when one rank's op input is bad."""


import pytest
import torch

from dist_harness import run_ranks
from test_mcore_layer import _config, _moe_spec, _rel_diff, _run

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
WAIT_S = 6.0


def _step(layer, x, grad):
    """(outcome, output error against the stock step or the exception's class name)."""
    try:
        return "ok", _run(layer, x, grad)
    except Exception as err:  # noqa: BLE001 - reported to the parent process
        return "raised", f"{type(err).__name__}: {err}"


def _faulted_steps(rank, world):
    import time

    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps

    from megatron_overlap.mcore import LayerPolicy, with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    config, spec = _config(1, 2), _moe_spec("grouped")
    g = torch.Generator().manual_seed(100 + rank)
    x, grad = torch.randn(12, 2, 32, generator=g), torch.randn(12, 2, 32, generator=g)
    torch.manual_seed(1234)
    ref = _run(spec(config=config), x, grad)
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="interpret", wait_timeout_s=WAIT_S),
                             LayerPolicy(fuse="always"))(config=config)

    def error(outcome):
        out, dx, grads = outcome[1]
        return max(_rel_diff(out, ref[0]), _rel_diff(dx, ref[1]),
                   max(_rel_diff(grads[k], ref[2][k]) for k in ref[2]))

    res = {"before": _step(layer, x, grad)}
    real = layer.overlap_session

    class Refusing:  # this rank's op refuses its call before it launches (C = 0)
        device = real.device

        def __call__(self, *args, **options):
            return real(*args, **dict(options, comm_ctas=0))

    if rank == 0:
        layer.overlap_session = Refusing()
    start = time.monotonic()
    res["fault"] = _step(layer, x, grad)
    res["fault_s"] = time.monotonic() - start
    layer.overlap_session = real
    res["after"] = _step(layer, x, grad)
    # rank 1's count of fused calls runs one ahead, as if it had made a call its peer did
    # not: their call tags differ, both raise, the counts restart alike
    if rank == 1:
        layer._fused_calls += 1
    res["desync"] = _step(layer, x, grad)
    res["resync"] = _step(layer, x, grad)
    ps.destroy_model_parallel()
    return {k: (v[0], error(v)) if isinstance(v, tuple) and v[0] == "ok" else v
            for k, v in res.items()}


@pytest.fixture(scope="module")
def steps():
    return run_ranks(2, _faulted_steps, timeout=300)


def test_a_fault_in_one_ranks_step_raises_on_every_rank_within_the_bound(steps):
    for rank, res in enumerate(steps):
        kind, message = res["fault"]
        assert kind == "raised", (rank, res)
        assert res["fault_s"] < 2 * WAIT_S + 10, (rank, res["fault_s"])
    assert "comm_ctas" in steps[0]["fault"][1]  # the refusing rank names its argument
    # its peer learns it in the barrier: a call marked failed does not pair
    assert steps[1]["fault"][1].startswith(
        ("OverlapMismatchError", "OverlapPeerError", "OverlapTimeoutError")), steps


def test_the_layers_next_step_is_correct_without_a_reset(steps):
    for rank, res in enumerate(steps):
        assert res["before"][0] == "ok" and res["before"][1] < 1e-5, (rank, res)
        assert res["after"][0] == "ok" and res["after"][1] < 1e-5, (rank, res)


def test_a_rank_a_call_ahead_raises_with_its_peer_by_call_tag_and_they_meet_again(steps):
    for rank, res in enumerate(steps):
        kind, message = res["desync"]
        assert kind == "raised" and message.startswith("OverlapMismatchError"), (rank, res)
        assert "call_tag=" in message, message
        assert res["resync"][0] == "ok" and res["resync"][1] < 1e-5, (rank, res)
