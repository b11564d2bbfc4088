"""Issue 55, the inputs: integer-like sizes are ints from the public boundary on, and
odd tensors give the reference backend's answer or an error naming the argument (one
rank, the interpreter)."""

import numpy as np
import pytest
import torch

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs
from routing_cases import routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
INTERP = OverlapConfig(backend="interpret")
REF = OverlapConfig(backend="reference")


def _call(p, tokens, topk, config=INTERP, **kw):
    return gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens, topk,
                           p["probs"], config=config, **kw)


def test_numpy_integer_sizes_are_accepted_and_do_not_poison_later_calls_of_the_shape():
    """numpy.int64 sizes on the first call of a shape (what fills every cache keyed on
    it) give the plain ints' bits, and a later call with plain ints still runs."""
    p = routed_problem(0, 1, tokens=40, experts=3, topk=2, ffn=16, hidden=24, seed=3)
    first = _call(p, np.int64(40), np.int64(2), comm_ctas=np.int64(3), splits=np.int32(2))
    again = _call(p, 40, 2, comm_ctas=3, splits=2)
    assert torch.equal(first, again)
    want = _call(p, 40, 2, config=REF)
    assert torch.allclose(first.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_zero_hidden_size_gives_the_reference_backends_empty_result():
    p = routed_problem(0, 1, tokens=24, experts=3, topk=2, ffn=16, hidden=8)
    p["weight"] = p["weight"][:, :0]  # [E, 0, K]
    got = _call(p, 24, 2)
    want = _call(p, 24, 2, config=REF)
    assert got.shape == want.shape == (24, 0) and got.dtype == want.dtype


def test_counts_on_another_device_than_x_are_an_error_naming_them():
    p = routed_problem(0, 1, tokens=24, experts=3, topk=2, ffn=16, hidden=32)
    p["counts"] = p["counts"].to("meta")
    with pytest.raises(ValueError, match=r"tokens_per_expert must be on the CPU or on x's "
                                         r"device \(cpu\), got a tensor on meta"):
        _call(p, 24, 2)


@pytest.mark.parametrize("tag", [-1, 1 << 15, 1.5, True, "3"])
def test_a_call_tag_out_of_its_range_is_an_error_naming_it(tag):
    p = routed_problem(0, 1, tokens=24, experts=3, topk=2, ffn=16, hidden=8)
    with pytest.raises((TypeError, ValueError), match="call_tag must be an int"):
        _call(p, 24, 2, call_tag=tag)


def test_a_call_tag_changes_no_result():
    p = routed_problem(0, 1, tokens=24, experts=3, topk=2, ffn=16, hidden=8)
    assert torch.equal(_call(p, 24, 2, call_tag=np.int64((1 << 15) - 1)), _call(p, 24, 2))


def test_the_cpu_order_check_allows_a_drop_only_where_an_expert_ends():
    """Megatron's order: tokens strictly ascending inside each expert's rows (empty experts
    included); a smaller token right after an expert's last row is the next expert's."""
    from megatron_overlap.ops.validation import validate

    x, w = torch.zeros(6, 8), torch.zeros(4, 16, 8)
    good = torch.tensor([3, 5, 0, 1, 4, 2])  # experts of 2, 0, 3, 1 rows
    validate(x, w, [2, 0, 3, 1], good, 6, 4, None, 1)
    with pytest.raises(ValueError, match="permutation order"):  # 5 then 4 inside expert 2
        validate(x, w, [2, 0, 3, 1], torch.tensor([3, 5, 0, 5, 4, 2]), 6, 4, None, 1)
    with pytest.raises(ValueError, match="permutation order"):  # a repeat inside expert 0
        validate(x, w, [2, 0, 3, 1], torch.tensor([3, 3, 0, 1, 4, 2]), 6, 4, None, 1)
    with pytest.raises(ValueError, match="permutation order"):  # the boundary moved
        validate(x, w, [3, 0, 2, 1], good, 6, 4, None, 1)
