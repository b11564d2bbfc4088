"""GatherRS with claimed items (`claims`, TileConfig.comm_dynamic_items): programs take
their items of a split from a counter instead of a fixed stride. Interpreter tests of the
bits, of who combines what, and of the counters' reset; the GPU tests run the same
kernel overlapped with GEMM2."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_overlap.kernels import gather_rs as grs
from megatron_overlap.kernels import gemm2
from routing_cases import routed_problem
from test_kernels import combine_once, gather_single_rank, run_gemm2

TOKENS, HIDDEN, BLOCK_TM, BLOCK_TN = 30, 40, 8, 16  # gather_single_rank's item shape


def problem():
    p = routed_problem(0, 1, tokens=TOKENS, experts=5, topk=3, ffn=16, hidden=HIDDEN)
    y, ready, tile_start = run_gemm2(p, splits=2, programs=3)
    return p, y, ready, tile_start


def launch_claimed(p, y, ready, tile_start, programs, claims, helpers=0, **kw):
    """GatherRS over 2 splits with `claims`; returns (out, ready, done, error, launch)."""
    out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, 2, programs,
                                                          probs=p["probs"])
    ready2.copy_(ready)
    grs.launch_gather_rs(*launch["args"], helpers=helpers, claims=claims, **launch["kwargs"],
                         **kw)
    return out, ready2, done, error, launch


def item_region(item: int, split: int) -> tuple[slice, slice]:
    """The output rows and columns of item `item` of split `split` (world 1, 20-column
    splits of 16-column items: 2 column blocks per split, the last one 4 wide)."""
    col_blocks, width = 2, HIDDEN // 2
    token_block, col_block = divmod(item, col_blocks)
    start = split * width + col_block * BLOCK_TN
    return (slice(token_block * BLOCK_TM, (token_block + 1) * BLOCK_TM),
            slice(start, min(start + BLOCK_TN, (split + 1) * width)))


@pytest.mark.parametrize("programs,helpers", [(1, 0), (3, 0), (2, 3), (7, 0)])
def test_claimed_items_give_the_bits_of_the_fixed_stride(programs, helpers):
    """Any C and H: the same output, bit for bit, and every counter left at zero."""
    p, y, ready, tile_start = problem()
    plain = combine_once(p, y, ready, tile_start, True, p["probs"])
    claims = torch.zeros(4, dtype=torch.int32)
    out, ready2, done, error, launch = launch_claimed(p, y, ready, tile_start, programs,
                                                      claims, helpers)
    if helpers:  # the helpers' launch, after GEMM2's (here: after the C programs)
        assert int(done) == programs
        grs.launch_gather_rs(*launch["args"], helpers=helpers, launch_helpers=True,
                             claims=claims, **launch["kwargs"])
    assert int(error) == 0 and int(done) == 0 and ready2.abs().sum() == 0
    assert claims.abs().sum() == 0  # reset by the last program for the next call
    assert torch.equal(out, plain)


def test_an_item_claimed_by_another_program_is_not_combined_again():
    """The counter is the only source of items: with split 0's counter at 4 (items 0-3
    claimed elsewhere) those stay as they were (poisoned), every other element is the
    plain combine's."""
    p, y, ready, tile_start = problem()
    plain = combine_once(p, y, ready, tile_start, True, p["probs"])
    claims = torch.tensor([4, 0, 0], dtype=torch.int32)
    out, _, _, error, _ = launch_claimed(p, y, ready, tile_start, 3, claims)
    assert int(error) == 0
    skipped = torch.zeros_like(out, dtype=torch.bool)
    for item in range(4):
        skipped[item_region(item, 0)] = True
    assert out[skipped].isnan().all()
    assert torch.equal(out[~skipped], plain[~skipped])


def test_tail_helpers_take_what_is_left_of_earlier_splits():
    """When GEMM2 ends the C programs may still be combining earlier splits: with claimed
    items the helpers start from split 0 and take what is left there, where with the
    fixed stride they only share the last split. Emulated: the C programs done
    (`done` = C) after claiming split 0's first 6 items (combined: copied from the plain
    output), then only the helpers launched. (With the fixed stride the helpers also
    leave the C programs' share of the last split, which those would still combine.)"""
    p, y, ready, tile_start = problem()
    plain = combine_once(p, y, ready, tile_start, True, p["probs"])
    programs, helpers = 2, 3
    results = {}
    for claimed in (False, True):
        out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, 2, programs,
                                                              probs=p["probs"])
        ready2.copy_(ready)
        done.fill_(programs)
        for item in range(6):
            out[item_region(item, 0)] = plain[item_region(item, 0)]
        claims = torch.tensor([6, 0], dtype=torch.int32) if claimed else None
        grs.launch_gather_rs(*launch["args"], helpers=helpers, launch_helpers=True,
                             claims=claims, **launch["kwargs"])
        assert int(error) == 0 and int(done) == 0 and ready2.abs().sum() == 0
        results[claimed] = out
    assert torch.equal(results[True], plain)  # split 0's backlog and the whole last split
    for item in (6, 7):  # split 0's items left (4 token blocks x 2 column blocks)
        assert results[False][item_region(item, 0)].isnan().all()  # fixed stride: left


@pytest.mark.parametrize("claims,got", [
    (torch.zeros(1, dtype=torch.int32), r"got \(1,\) torch.int32"),  # fewer words than L
    (torch.zeros(4, dtype=torch.int64), "torch.int64"),
    (torch.zeros(4, 2, dtype=torch.int32)[:, 0], r"got \(4,\) torch.int32"),  # strided
    ("0", "got str"),
])
def test_bad_claims_are_refused_before_the_launch(claims, got):
    p, y, ready, tile_start = problem()
    out, _, _, _, launch = gather_single_rank(p, y, tile_start, 2, 3)
    with pytest.raises(ValueError, match=r"claims must be a contiguous int32 tensor \[>= 2\].*"
                       + got):
        grs.launch_gather_rs(*launch["args"], claims=claims, **launch["kwargs"])
    assert out.isnan().all()


def split_items(hidden: int, splits: int, tokens: int) -> list[tuple[int, int, int]]:
    """(first column, width, column blocks) of each split, and the token blocks, as the
    kernel counts them (gather_single_rank's 8 x 16 items)."""
    sw = gemm2.split_width(hidden, splits)
    widths = [sw] * (splits - 1) + [hidden - (splits - 1) * sw]
    return [(s * sw, w, -(-w // BLOCK_TN)) for s, w in enumerate(widths)], -(-tokens // BLOCK_TM)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10**6), st.integers(9, 40), st.integers(3, 7), st.integers(16, 72),
       st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.lists(
           st.floats(0, 1), min_size=3, max_size=3))
def test_helpers_finish_any_progress_the_programs_left_with_the_same_bits(
        seed, tokens, experts, hidden, splits, programs, helpers, progress):
    """Whatever the C programs had claimed and combined of each split when GEMM2 ended
    (claims[s] preset to any count, those items copied from the plain combine), the
    helpers launched after it combine every item left, in every split, to the plain
    combine's bits, and the last of them resets every flag and counter."""
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=3, ffn=16, hidden=hidden,
                       seed=seed)
    y, ready, tile_start = run_gemm2(p, splits=splits, programs=3)
    tokens = int(p["token_index"].max()) + 1  # (gather_single_rank's M)
    out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, splits, programs,
                                                          probs=p["probs"])
    ready2.copy_(ready)
    grs.launch_gather_rs(*launch["args"], **launch["kwargs"])  # the fixed stride, C programs
    plain = out.clone()
    out.fill_(float("nan"))
    ready2.copy_(ready)
    layout, token_blocks = split_items(hidden, splits, tokens)
    claims = torch.zeros(splits, dtype=torch.int32)
    for s, (first_col, width, col_blocks) in enumerate(layout):
        claims[s] = round(progress[s] * token_blocks * col_blocks)
        for item in range(int(claims[s])):
            token_block, col_block = divmod(item, col_blocks)
            rows = slice(token_block * BLOCK_TM, (token_block + 1) * BLOCK_TM)
            start = first_col + col_block * BLOCK_TN
            cols = slice(start, min(start + BLOCK_TN, first_col + width))
            out[rows, cols] = plain[rows, cols]
    done.fill_(programs)  # the C programs are done
    grs.launch_gather_rs(*launch["args"], helpers=helpers, launch_helpers=True, claims=claims,
                         **launch["kwargs"])
    assert int(error) == 0 and int(done) == 0 and ready2.abs().sum() == 0
    assert claims.abs().sum() == 0
    assert not plain.isnan().any() and torch.equal(out, plain)
