"""The layer's dispatcher postprocesses against Megatron-Core's `permute` (CPU, random
routings): the same rows, permutation, probabilities and counts, bit for bit."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")
from megatron.core.transformer.moe.moe_utils import permute  # noqa: E402

from megatron_overlap.mcore.dispatch import (  # noqa: E402
    MAX_PADDING,
    deferred_postprocess,
    single_sync_postprocess,
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


def _dispatcher(routing, local):
    return types.SimpleNamespace(routing_map=routing, local_expert_indices=local,
                                 config=types.SimpleNamespace(moe_expert_capacity_factor=None))


def _megatron(routing, probs, local, hidden):
    local_map = routing[:, local[0]:local[-1] + 1].contiguous()
    counts = local_map.sum(dim=0).long()
    rows, _, order, _, _ = permute(hidden, local_map, num_out_tokens=int(counts.sum()))
    local_probs = probs[:, local[0]:local[-1] + 1].contiguous()
    return rows, counts, local_probs.T.contiguous().masked_select(local_map.T.contiguous()), order


@settings(max_examples=60, deadline=None)
@given(routings())
def test_postprocesses_give_megatrons_rows_order_probs_and_counts(case):
    routing, probs, local, topk = case
    hidden = torch.randn(routing.shape[0], 4)
    rows, counts, want_probs, order = _megatron(routing, probs, local, hidden)
    disp = _dispatcher(routing, local)
    got = single_sync_postprocess(disp, hidden, probs)
    assert torch.equal(got[0], rows) and torch.equal(got[1], counts)
    assert torch.equal(got[2], want_probs)
    assert torch.equal(disp.reversed_local_input_permutation_mapping, order)
    assert disp.routing_map is None
    late = deferred_postprocess(_dispatcher(routing, local), hidden, probs, topk)
    if len(local) < routing.shape[1]:  # experts elsewhere: the size needs the counts
        assert late is None
    else:
        assert torch.equal(late.permuted, rows)
        assert torch.equal(late.tokens_per_expert(), counts)
        assert torch.equal(late.probs, want_probs) and not late.padded
    # inference: the rows padded to their bound; the first ones, trimmed, are Megatron's
    disp = _dispatcher(routing, local)
    padded = deferred_postprocess(disp, hidden, probs, topk, pad=True)
    tokens, experts = routing.shape
    bound = tokens * min(topk, len(local))
    if bound > MAX_PADDING * -(-tokens * topk * len(local) // experts):
        assert padded is None  # too much padding: the single-sync postprocess runs
        return
    assert padded.permuted.shape[0] == bound and padded.padded
    if len(local) < experts:  # padded by design: the work on the padding is skipped
        assert int(padded.valid_rows) == int(counts.sum())
    else:
        assert padded.valid_rows is None
    assert torch.equal(padded.tokens_per_expert(), counts)
    padded.trim(disp, int(counts.sum()))
    assert torch.equal(padded.permuted, rows) and torch.equal(padded.probs, want_probs)
    assert torch.equal(disp.reversed_local_input_permutation_mapping, order)
    assert torch.equal(disp.local_probs, want_probs)


def test_deferred_postprocess_pads_with_valid_rows_where_a_token_has_fewer_experts():
    """A dropped assignment: the counts sum below M x top-k, which the layer detects (and
    redoes); the padding must index real rows meanwhile, not -1."""
    routing = torch.tensor([[True, True], [True, False], [False, True]])
    probs = torch.rand(3, 2)
    late = deferred_postprocess(_dispatcher(routing, [0, 1]), torch.randn(3, 4), probs, 2)
    assert late.permuted.shape[0] == 6 and int(late.tokens_per_expert().sum()) == 4
    assert late.routing_map is routing and int(late.counts_dev.sum()) == 4
    assert int(late.permuted.abs().sum(dim=1).eq(0).sum()) == 0  # no row left unwritten


def test_deferred_postprocess_declines_a_router_that_drops_tokens():
    disp = _dispatcher(torch.ones(4, 2, dtype=torch.bool), [0, 1])
    disp.config.moe_expert_capacity_factor = 1.0
    assert deferred_postprocess(disp, torch.randn(4, 4), torch.rand(4, 2), 2) is None


def test_rows_bound_is_top_k_rows_per_token_capped_by_the_local_experts_unless_too_loose():
    from megatron_overlap.mcore.dispatch import MAX_PADDING, rows_bound

    assert rows_bound(100, 2, 4, 4) == 200  # every expert local: the rows exactly
    assert rows_bound(100, 2, 1, 4) == 100  # one local expert: a row per token at most
    assert rows_bound(100, 8, 8, 64) is None  # 8x a uniform routing's rows > MAX_PADDING
    assert rows_bound(100, 8, 8, 8 * MAX_PADDING) == 800
