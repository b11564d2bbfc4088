"""The fused path's dispatcher (`OverlapAllGatherDispatcher`) against Megatron-Core's own
`MoEAllGatherTokenDispatcher.dispatch_postprocess` (CPU, random routings): the same rows,
permutation, probabilities, counts and dispatcher state, bit for bit; and Megatron's
methods left as Megatron's."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")
from megatron.core.transformer.moe.token_dispatcher import (  # noqa: E402
    MoEAllGatherTokenDispatcher,
)

from megatron_overlap.mcore.dispatch import (  # noqa: E402
    MAX_PADDING,
    OverlapAllGatherDispatcher,
    Permuted,
    rows_bound,
)


@st.composite
def routings(draw):
    """(routing map [M, E] bool with exactly top-k experts per token, probs, local range):
    uniform draws, or every token on one hot expert plus others (empty experts)."""
    tokens = draw(st.integers(1, 40))
    experts = draw(st.integers(1, 8))
    topk = draw(st.integers(1, experts))
    seed = draw(st.integers(0, 2**16))
    hot = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if hot:
        scores[:, 0] += 2.0  # expert 0 in every token's top-k; the tail experts starve
    chosen = scores.topk(topk, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=g) * routing
    lo = draw(st.integers(0, experts - 1))
    hi = draw(st.integers(lo + 1, experts))
    return routing, probs, list(range(lo, hi)), topk


def _dispatcher(cls, routing, local, topk, **config):
    """A `cls` dispatcher as MoELayer builds it (no process groups: TP = EP = 1 sizes),
    holding `routing` as `dispatch_preprocess` leaves it."""
    config = types.SimpleNamespace(**dict(
        dict(moe_router_topk=topk, add_bias_linear=False, moe_expert_capacity_factor=None,
             moe_permute_fusion=False, num_moe_experts=routing.shape[1]), **config))
    groups = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)
    disp = cls(len(local), local, config=config, pg_collection=groups)
    disp.routing_map = routing
    return disp


def _state(disp) -> dict:
    return dict(vars(disp))


def _same_state(a: dict, b: dict) -> bool:
    """Every attribute equal (tensors bitwise, the config the same object)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif key != "config" and x != y:
            return False
    return True


def _megatron(routing, probs, local, topk, hidden):
    """Megatron's postprocess: its outputs and the state it leaves."""
    disp = _dispatcher(MoEAllGatherTokenDispatcher, routing, local, topk)
    out = disp.dispatch_postprocess(hidden, probs)
    return out, _state(disp)


def _equal(got, want) -> bool:
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


def test_the_dispatcher_overrides_none_of_megatrons_methods():
    """The stock path (overlap off, or a size the planner leaves stock) calls Megatron's
    own `dispatch_postprocess` and combine on the installed dispatcher."""
    ours = {name for name in vars(OverlapAllGatherDispatcher) if not name.startswith("__")}
    assert not ours & set(dir(MoEAllGatherTokenDispatcher)), ours & set(dir(
        MoEAllGatherTokenDispatcher))
    for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                 "combine_preprocess", "token_combine", "combine_postprocess"):
        assert getattr(OverlapAllGatherDispatcher, name) is getattr(
            MoEAllGatherTokenDispatcher, name)


@settings(max_examples=60, deadline=None)
@given(routings())
def test_installed_dispatchers_stock_postprocess_gives_megatrons_outputs_and_state(case):
    routing, probs, local, topk = case
    hidden = torch.randn(routing.shape[0], 4)
    want, state = _megatron(routing, probs, local, topk, hidden)
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk)
    assert _equal(disp.dispatch_postprocess(hidden, probs), want)
    assert _same_state(_state(disp), state)


@settings(max_examples=60, deadline=None)
@given(routings())
def test_single_sync_postprocess_gives_megatrons_outputs_and_state(case):
    routing, probs, local, topk = case
    hidden = torch.randn(routing.shape[0], 4)
    want, state = _megatron(routing, probs, local, topk, hidden)
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk)
    got = disp.single_sync_postprocess(hidden, probs)
    assert _equal(got, want) and _same_state(_state(disp), state)
    permuted = disp.permuted(*got, te_row_map=False)  # what the op reads
    assert isinstance(permuted, Permuted) and _equal(
        (permuted.rows, permuted.counts, permuted.probs, permuted.token_index),
        (*want, state["reversed_local_input_permutation_mapping"]))
    assert permuted.num_tokens == routing.shape[0] and permuted.expected_rows is None


@settings(max_examples=60, deadline=None)
@given(routings())
def test_deferred_postprocess_settles_to_megatrons_rows_exact_or_padded(case):
    """Every expert local: exact; in inference (pad) the rows padded to their bound, whose
    first ones, once `settle` trims them, are Megatron's (dispatcher state too)."""
    routing, probs, local, topk = case
    tokens, experts = routing.shape
    hidden = torch.randn(tokens, 4)
    want, state = _megatron(routing, probs, local, topk, hidden)
    for pad in (False, True):
        disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk)
        late = disp.deferred_postprocess(hidden, probs, topk, pad=pad)
        bound = tokens * min(topk, len(local))
        if (len(local) < experts and not pad) or bound > MAX_PADDING * -(
                -tokens * topk * len(local) // experts):
            assert late is None  # the size needs the counts, or too much padding
            continue
        assert late.permuted.shape[0] == bound and late.padded == pad
        assert late.routing_map is routing and disp.routing_map is None
        if pad and len(local) < experts:  # padded by design: the work on it is skipped
            assert int(late.valid_rows) == int(want[1].sum())
        else:
            assert late.valid_rows is None
        settled = disp.settle(late)
        assert _equal((settled.rows, settled.counts, settled.probs), want)
        assert torch.equal(settled.token_index, state["reversed_local_input_permutation_mapping"])
        assert _same_state(_state(disp), state)


@settings(max_examples=30, deadline=None)
@given(routings())
def test_counts_kept_on_the_device_cover_the_bound_with_a_uniform_routings_plan(case):
    routing, probs, local, topk = case
    tokens, experts = routing.shape
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk)
    late = disp.deferred_postprocess(torch.randn(tokens, 4), probs, topk, pad=True,
                                     host_copy=False)
    if late is None:
        return
    permuted = disp.permuted_on_device(late)
    assert permuted.rows is late.permuted and permuted.counts is late.counts_dev
    assert permuted.token_index.shape[0] == late.permuted.shape[0]
    want = None if len(local) == experts else min(
        late.permuted.shape[0], tokens * topk * len(local) // experts)
    assert permuted.expected_rows == want


@settings(max_examples=30, deadline=None)
@given(routings())
def test_an_ungathered_permutation_keeps_the_tokens_and_gathers_nothing(case):
    """`gather=False` with the counts on the device (the grouped FP8 path reads the rows
    by token): no rows, the tokens before the permutation as the source, the same token
    of each row, probabilities and counts as the gathered one's; nothing to trim."""
    routing, probs, local, topk = case
    tokens = routing.shape[0]
    hidden = torch.randn(tokens, 4)
    ref = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk).deferred_postprocess(
        hidden, probs, topk, pad=True, host_copy=False)
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk)
    late = disp.deferred_postprocess(hidden, probs, topk, pad=True, host_copy=False,
                                     gather=False)
    if late is None:
        assert ref is None
        return
    assert late.permuted is None and late.source is hidden and late.bound == ref.bound
    assert torch.equal(late.token_index, ref.token_index)
    real = int(ref.counts_dev.sum())  # (past them the gathered rows are padding)
    assert torch.equal(hidden[late.token_index][:real], ref.permuted[:real])
    assert torch.equal(late.probs, ref.probs) and torch.equal(late.counts_dev, ref.counts_dev)
    permuted = disp.permuted_on_device(late)
    assert permuted.rows is None and torch.equal(permuted.token_index, late.token_index)
    with pytest.raises(RuntimeError, match="no rows to trim"):
        disp.settle(late)


def test_settle_asks_for_a_redo_where_a_token_has_fewer_experts_and_rows_may_not_pad():
    """A dropped assignment: the counts sum below M x top-k. With a gradient (no pad)
    `settle` gives the routing map back and the single-sync postprocess redoes it; in
    inference it trims. The padding indexes real rows meanwhile, not -1."""
    routing = torch.tensor([[True, True], [True, False], [False, True]])
    probs, hidden = torch.rand(3, 2), torch.randn(3, 4)
    want, state = _megatron(routing, probs, [0, 1], 2, hidden)
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, [0, 1], 2)
    late = disp.deferred_postprocess(hidden, probs, 2)
    assert late.permuted.shape[0] == 6 and int(late.counts_dev.sum()) == 4
    assert int(late.permuted.abs().sum(dim=1).eq(0).sum()) == 0  # no row left unwritten
    assert disp.settle(late) is None and disp.routing_map is routing
    assert _equal(disp.single_sync_postprocess(hidden, probs), want)
    assert _same_state(_state(disp), state)
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, [0, 1], 2)
    settled = disp.settle(disp.deferred_postprocess(hidden, probs, 2, pad=True))
    assert _equal((settled.rows, settled.counts, settled.probs), want)


def test_deferred_postprocess_declines_a_capacity_factor():
    disp = _dispatcher(OverlapAllGatherDispatcher, torch.ones(4, 2, dtype=torch.bool), [0, 1],
                       2, moe_expert_capacity_factor=1.0)
    assert disp.deferred_postprocess(torch.randn(4, 4), torch.rand(4, 2), 2) is None


def test_fused_permutes_token_index_is_megatrons_permutation_order():
    """TE's fused permute keeps no token of each row (its mapping is a row-id map):
    `Permuted` rebuilds it from the local map (expert-major, token-ascending), what the
    unfused permute records; the caller says so, the config's flag is not read."""
    routing = torch.rand(9, 4).argsort(dim=1) < 2
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, [1, 2], 2)
    out = disp.dispatch_postprocess(torch.randn(9, 4), torch.rand(9, 4))
    order = disp.reversed_local_input_permutation_mapping
    disp.reversed_local_input_permutation_mapping = torch.full_like(order, -1)  # TE's map
    assert torch.equal(disp.permuted(*out, te_row_map=True).token_index, order)


@settings(max_examples=30, deadline=None)
@given(routings())
def test_our_postprocesses_give_the_token_of_each_row_with_moe_permute_fusion_set(case):
    """The fused path runs its own postprocesses whatever `moe_permute_fusion` says: with
    the flag on, the settled and single-sync rows still carry Megatron's unfused
    permutation order as their tokens (not a rebuild from TE's row-id map)."""
    routing, probs, local, topk = case
    hidden = torch.randn(routing.shape[0], 4)
    want, state = _megatron(routing, probs, local, topk, hidden)
    order = state["reversed_local_input_permutation_mapping"]
    disp = _dispatcher(OverlapAllGatherDispatcher, routing, local, topk,
                       moe_permute_fusion=True)
    late = disp.deferred_postprocess(hidden, probs, topk, pad=True)
    if late is not None:
        settled = disp.settle(late)
        assert settled._local_map is None and torch.equal(settled.token_index, order)
        disp.routing_map = routing
    single = disp.permuted(*disp.single_sync_postprocess(hidden, probs), te_row_map=False)
    assert _equal((single.rows, single.counts, single.probs), want)
    assert single._local_map is None and torch.equal(single.token_index, order)


def test_rows_bound_is_top_k_rows_per_token_capped_by_the_local_experts_unless_too_loose():
    assert rows_bound(100, 2, 4, 4) == 200  # every expert local: the rows exactly
    assert rows_bound(100, 2, 1, 4) == 100  # one local expert: a row per token at most
    assert rows_bound(100, 8, 8, 64) is None  # 8x a uniform routing's rows > MAX_PADDING
    assert rows_bound(100, 8, 8, 8 * MAX_PADDING) == 800
