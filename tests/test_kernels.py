"""The Triton kernels against their pure-torch references (interpreter on CPU)."""

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_overlap.kernels import gather_rs as grs
from megatron_overlap.kernels import gemm2
from megatron_overlap.kernels import gemm2_places
from megatron_overlap.kernels import routing_table as rt
from megatron_overlap.kernels import sum_partials as sp
from megatron_overlap.kernels import gated_add, gather_rows, swiglu
from routing_cases import fp64_rank_partial, rel_err, routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests")


def run_gemm2(p, splits, programs, block=16):
    x, w = p["x"], p["weight"]
    y = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype)  # poisoned
    row_start, tile_start = gemm2.expert_offsets(p["counts"], block)
    ready = torch.zeros(8, dtype=torch.int32)
    gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, ready, splits=splits,
                               programs=programs, block_m=block, block_n=block, block_k=block,
                               upcast=True)
    return y, ready, tile_start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm2_matches_fp64_with_uneven_and_empty_experts(dtype):
    p = routed_problem(0, 1, tokens=37, experts=6, topk=2, ffn=40, hidden=56, dtype=dtype,
                       empty=(2,))
    assert p["counts"][2] == 0
    y, _, _ = run_gemm2(p, splits=3, programs=5)
    assert not torch.isnan(y).any(), "every element of y must be written"
    ref = gemm2.grouped_gemm2_reference(p["x"].double(), p["weight"].double(), p["counts"].tolist())
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


def _token_major(p, tokens, topk, places, block=16):
    """GEMM2 into a NaN-poisoned token-major y [M k, N] at `places`."""
    x, w = p["x"], p["weight"]
    y = torch.full((tokens * topk, w.shape[1]), float("nan"), dtype=x.dtype)
    row_start, tile_start = gemm2.expert_offsets(p["counts"], block)
    gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, torch.zeros(8, dtype=torch.int32),
                               splits=2, programs=3, block_m=block, block_n=block,
                               block_k=block, upcast=True, places=places)
    return y


@pytest.mark.parametrize("from_dest", [False, True])
@pytest.mark.parametrize("experts", [4, 40])  # one mark word, two
def test_gemm2_finds_each_rows_token_major_place_from_the_marks_as_the_routing_table_does(
        experts, from_dest):
    """GEMM2 places row j at y[t k + s], s from its token's expert mask: the place the
    routing's second pass writes into dest (and the pure-torch reference), so y is the
    row-order product permuted, every row written, bit for bit; the same reading the
    places from that dest (`TokenPlaces.dest`, the op's default)."""
    tokens, topk = 37, 3
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=topk, ffn=16, hidden=48)
    rows_y, _, _ = run_gemm2(p, splits=2, programs=3)
    marks, want = gemm2_places.token_places_reference(p["token_index"], p["counts"].tolist(),
                                                      tokens, topk)
    row_start, _ = gemm2.expert_offsets(p["counts"], 16)
    dest = torch.empty(rows_y.shape[0], dtype=torch.int32)
    passes = rt.route_rows(p["token_index"], row_start, tokens, topk,
                           torch.zeros(1, dtype=torch.int32), dest)
    assert torch.equal(passes.marks, marks) and torch.equal(dest.long(), want)
    places = gemm2.TokenPlaces(p["token_index"], passes.marks, passes.words, topk,
                               dest if from_dest else None)
    y = _token_major(p, tokens, topk, places)
    assert torch.equal(y[want], rows_y) and not y.isnan().any()


def test_the_routings_dest_is_minus_one_for_a_row_it_does_not_place():
    """A token with more rows than k (bad input, recorded in the error word): the second
    pass leaves its extra row out of the table and writes -1 into dest for it, which
    GEMM2 reading dest then drops, instead of leaving dest's old contents there."""
    token_index = torch.tensor([0, 1, 0, 2], dtype=torch.int32)  # experts 0, 0, 1, 2
    row_start = torch.tensor([0, 2, 3, 4], dtype=torch.int32)
    dest = torch.full((4,), 12345, dtype=torch.int32)
    error = torch.zeros(1, dtype=torch.int32)
    rt.route_rows(token_index, row_start, 4, 1, error, dest)  # k = 1
    assert dest.tolist() == [0, 1, -1, 2] and int(error) == 4 << 24


def test_gemm2_reading_dest_drops_the_rows_it_places_outside_y():
    """With `TokenPlaces.dest`, a row at -1 or past y's rows is dropped; every other row
    lands at its dest, bit for bit, and nothing else of y is written."""
    tokens, topk = 37, 2
    p = routed_problem(0, 1, tokens=tokens, experts=4, topk=topk, ffn=16, hidden=48)
    rows_y, _, _ = run_gemm2(p, splits=2, programs=3)
    marks, want = gemm2_places.token_places_reference(p["token_index"], p["counts"].tolist(),
                                                      tokens, topk)
    dest = want.to(torch.int32)
    dest[3], dest[40] = -1, tokens * topk  # not placed; outside y
    y = _token_major(p, tokens, topk, gemm2.TokenPlaces(p["token_index"], marks, 1, topk,
                                                        dest))
    kept = (dest >= 0) & (dest < tokens * topk)
    assert int(kept.sum()) == dest.numel() - 2
    assert torch.equal(y[dest[kept].long()], rows_y[kept])
    written = torch.zeros(y.shape[0], dtype=torch.bool)
    written[dest[kept].long()] = True
    assert y[~written].isnan().all()


def test_gemm2_drops_rows_whose_token_or_slot_lies_outside_y():
    """Bad input the routing records (a token outside [0, M), a token with more than k
    rows): those rows are dropped, nothing is written outside their places."""
    tokens, topk = 37, 2
    p = routed_problem(0, 1, tokens=tokens, experts=4, topk=topk, ffn=16, hidden=48)
    rows_y, _, _ = run_gemm2(p, splits=2, programs=3)
    marks, want = gemm2_places.token_places_reference(p["token_index"], p["counts"].tolist(),
                                                      tokens, topk)
    bad = p["token_index"].clone()
    bad[3], bad[4] = tokens, -1  # outside y
    # a token with rows in experts {e < 2, 3} given a mark of expert 2 too (a third row
    # it does not have): its row of expert 3 counts two experts below: slot 2 >= k
    expert = torch.repeat_interleave(torch.arange(4), p["counts"])
    over = next(j for j in range(len(bad)) if int(expert[j]) == 3 and j > 4
                and (marks[int(bad[j])] & 0b0111) in (0b0001, 0b0010))
    marks[int(bad[over])] |= 0b0100
    y = _token_major(p, tokens, topk, gemm2.TokenPlaces(bad, marks, 1, topk))
    kept = torch.ones(rows_y.shape[0], dtype=torch.bool)
    kept[[3, 4, over]] = False
    assert torch.equal(y[want[kept]], rows_y[kept])
    written = torch.zeros(y.shape[0], dtype=torch.bool)
    written[want[kept]] = True
    assert y[~written].isnan().all()


def test_gemm2_publishes_every_tile_of_every_split():
    p = routed_problem(0, 1, tokens=37, experts=4, topk=2, ffn=16, hidden=50)
    _, ready, tile_start = run_gemm2(p, splits=3, programs=4)
    # sw = 17 (2 column tiles of 16); the last split holds 50 - 34 = 16 columns (1 tile)
    assert gemm2.split_col_tiles(50, 3, gemm2.split_width(50, 3), 16) == (2, 1)
    assert ready[:3].tolist() == [int(tile_start[-1]) * c for c in (2, 2, 1)]
    assert ready[3:].abs().sum() == 0


def test_combine_table_lists_each_tokens_rows_in_row_order():
    token_index = torch.tensor([3, 0, 3, 1, 0, 3])
    table = rt.combine_table(token_index, num_tokens=5, topk=3)
    assert table.tolist() == [[1, 4, -1], [3, -1, -1], [-1, -1, -1], [0, 2, 5], [-1, -1, -1]]


def gather_single_rank(p, y, tile_start, splits, programs, max_spins=100000, probs=None):
    tokens = int(p["token_index"].max()) + 1
    table = rt.combine_table(p["token_index"], tokens, 3)
    out = torch.full((tokens, y.shape[1]), float("nan"), dtype=y.dtype)
    dst = torch.zeros(1, dtype=torch.int64)  # world 1 writes into partial_like, reads no address
    ready = torch.zeros(8, dtype=torch.int32)
    done, error = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return out, ready, done, error, dict(
        args=(y, table, probs, dst, dst, ready, done, error, tile_start),
        kwargs=dict(tokens_per_rank=tokens, splits=splits, rank=0, world=1,
                    gemm_col_tiles=gemm2.split_col_tiles(
                        y.shape[1], splits, gemm2.split_width(y.shape[1], splits), 16)[0],
                    gemm_last_col_tiles=gemm2.split_col_tiles(
                        y.shape[1], splits, gemm2.split_width(y.shape[1], splits), 16)[1],
                    epoch=done,  # (world 1: no barrier, not read)
                    max_spins=max_spins, partial_like=out, dst_slot_stride=0,
                    dst_row_stride=out.stride(0), programs=programs, block_tm=8, block_tn=16,
                    num_warps=4))


def combine_once(p, y, ready, tile_start, slot_loop, probs):
    out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, 2, 3, probs=probs)
    ready2.copy_(ready)
    grs.launch_gather_rs(*launch["args"], slot_loop=slot_loop, **launch["kwargs"])
    assert int(error) == 0 and int(done) == 0 and ready2.abs().sum() == 0  # flags reset
    return out


@pytest.mark.parametrize("slot_loop", [True, False])
def test_gather_rs_single_rank_combines_topk_rows_with_probs(slot_loop):
    p = routed_problem(0, 1, tokens=30, experts=5, topk=3, ffn=16, hidden=40)
    y, ready, tile_start = run_gemm2(p, splits=2, programs=3)
    out = combine_once(p, y, ready, tile_start, slot_loop, p["probs"])
    ref = fp64_rank_partial(p, 30, with_probs=True)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("probs", [False, True])
def test_token_major_gather_gives_the_bits_of_the_row_order_gather(probs):
    """The same y rows read at t*k + s, with no table read, instead of through the table:
    the same sum (every token has its 3 rows, as under TP)."""
    p = routed_problem(0, 1, tokens=30, experts=6, topk=3, ffn=16, hidden=40)
    y, ready, tile_start = run_gemm2(p, splits=2, programs=3)
    w = p["probs"] if probs else None
    plain = combine_once(p, y, ready, tile_start, True, w)
    table = rt.combine_table(p["token_index"], 30, 3)
    assert y.shape[0] == table.numel()
    y_tok = torch.full_like(y, float("nan"))
    y_tok[token_major_rows(table, y.shape[0]).long()] = y
    assert not torch.isnan(y_tok).any()
    out, ready2, done, error, launch = gather_single_rank(p, y_tok, tile_start, 2, 3, probs=w)
    ready2.copy_(ready)
    grs.launch_gather_rs(*launch["args"], token_major=True, **launch["kwargs"])
    assert int(error) == 0
    assert torch.equal(out, plain)


def test_item_pipeline_depth_is_lowered_to_what_shared_memory_holds():
    item = 64 * 1024 * 2  # one item of 64 gathered rows x 1024 bf16 columns: 128 KiB
    assert grs.fit_item_stages(1, item) == 1
    assert grs.fit_item_stages(2, item) == 2  # one item in flight fits the 192 KiB budget
    assert grs.fit_item_stages(4, item) == 2  # three would not
    assert grs.fit_item_stages(6, item // 4) == 6
    assert grs.fit_item_stages(3, 10 * grs.ITEM_PIPELINE_BYTES) == 1
    with pytest.raises(ValueError, match="comm_stages"):
        grs.fit_item_stages(0, item)


def test_pipelined_item_loop_combines_the_same_as_the_plain_one():
    """The interpreter ignores the pipeline depth; this checks the launch path carries it
    (compile_check and the GPU tests check what the compiler makes of it)."""
    p = routed_problem(0, 1, tokens=30, experts=5, topk=3, ffn=16, hidden=40)
    y, ready, tile_start = run_gemm2(p, splits=2, programs=3)
    outs = []
    for stages in (1, 3):
        out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, 2, 3)
        ready2.copy_(ready)
        grs.launch_gather_rs(*launch["args"], item_stages=stages, **launch["kwargs"])
        assert int(error) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], fp64_rank_partial(p, 30)) < 1e-2


def test_tail_helpers_share_the_last_split_and_give_the_same_bits():
    """C = 2 communication programs, then H = 3 helpers launched separately (as after
    GEMM2): helpers take only last-split items, and the last of all 5 resets the flags."""
    p = routed_problem(0, 1, tokens=30, experts=5, topk=3, ffn=16, hidden=40)
    y, ready, tile_start = run_gemm2(p, splits=2, programs=3)
    plain = combine_once(p, y, ready, tile_start, True, p["probs"])
    out, ready2, done, error, launch = gather_single_rank(p, y, tile_start, 2, 2,
                                                          probs=p["probs"])
    ready2.copy_(ready)
    out.fill_(float("nan"))  # poison: every element must be written
    grs.launch_gather_rs(*launch["args"], helpers=3, **launch["kwargs"])
    assert int(done) == 2 and int(ready2.abs().sum()) > 0  # waits for the helpers
    assert not torch.isnan(out[:, :out.shape[1] // 2]).any()  # split 0: the C programs'
    last_split = out[:, -(out.shape[1] // 2):]
    assert torch.isnan(last_split).any()  # the helpers' share is still missing
    grs.launch_gather_rs(*launch["args"], helpers=3, launch_helpers=True, **launch["kwargs"])
    assert int(error) == 0 and int(done) == 0 and ready2.abs().sum() == 0
    assert torch.equal(out, plain)


def test_missing_producer_times_out_with_split_code_instead_of_hanging():
    p = routed_problem(0, 1, tokens=20, experts=3, topk=2, ffn=16, hidden=32)
    y, _, tile_start = run_gemm2(p, splits=2, programs=2)
    out, ready, done, error, launch = gather_single_rank(p, y, tile_start, 2, 2, max_spins=20)
    ready[1] = 10 ** 6  # split 1 is ready, split 0's producers never ran
    grs.launch_gather_rs(*launch["args"], **launch["kwargs"])
    assert int(error) == (grs.ERR_READY_TIMEOUT << 24) | 0


# ----------------------------------------------------------------- routing table kernel
def token_major_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The routing table's inverse in pure torch: dest[table[t, s]] = t * k + s."""
    dest = torch.full((rows,), -1, dtype=torch.int32)
    where = table >= 0
    slots = torch.arange(table.numel(), dtype=torch.int32).view(table.shape)
    dest[table[where].long()] = slots[where]
    return dest


def test_routing_table_kernel_flags_a_token_with_more_rows_than_topk():
    """Rows of 3 experts for every token but topk 2: the third would be dropped."""
    token_index, counts = _megatron_rows(4, 20, 6, 6, 3)
    row_start, _, _ = gemm2.expert_offsets_host(counts, 16, "cpu")
    error = torch.zeros(1, dtype=torch.int32)
    rt.launch_routing_table(token_index, row_start, 20, 2, error,
                            torch.empty(token_index.numel(), dtype=torch.int32))
    assert int(error) >> 24 == rt.ERR_TOPK


def _megatron_rows(seed, tokens, experts, local, topk):
    """token_index and counts of one EP rank, in Megatron's permutation order."""
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    mine = topk_idx < local
    flat_e = topk_idx[mine]
    flat_t = torch.arange(tokens)[:, None].expand_as(topk_idx)[mine]
    order = torch.argsort(flat_e * tokens + flat_t)
    return flat_t[order], torch.bincount(flat_e, minlength=local).tolist()


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 40), st.integers(1, 9), st.integers(1, 4))
def test_routing_table_kernel_equals_the_argsort_reference(seed, tokens, experts, topk):
    topk = min(topk, experts)
    local = max(1, experts // 2) if seed % 2 else experts  # EP: some rows elsewhere
    token_index, counts = _megatron_rows(seed, tokens, experts, local, topk)
    packed, _ = gemm2.packed_offsets_host(counts, 16, "cpu")
    tables = []
    for from_counts in (False, True):  # offsets given, or summed by the kernel itself
        error = torch.zeros(1, dtype=torch.int32)
        dest = torch.full((token_index.numel(),), -7, dtype=torch.int32)
        filled = torch.full_like(packed, -9)  # the op's device offsets, by the same launch
        table = rt.launch_routing_table(
            token_index, torch.tensor(counts, dtype=torch.int32) if from_counts
            else packed[:len(counts) + 1], tokens, topk, error, dest,
            from_counts=(filled, 16) if from_counts else None)
        assert int(error) == 0
        assert torch.equal(dest, token_major_rows(table, token_index.numel()))
        if from_counts:
            assert torch.equal(filled, packed)
        tables.append(table)
    assert torch.equal(tables[0], rt.combine_table(token_index, tokens, topk))
    assert torch.equal(tables[1], tables[0])


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 30), st.integers(1, 130), st.integers(1, 8))
def test_gemm2_places_every_row_where_the_routing_table_does_for_any_routing(
        seed, tokens, experts, topk):
    """Any routing (up to 130 experts: five mask words; every token with its k rows):
    GEMM2's own places from the first pass's marks are the second pass's dest."""
    topk = min(topk, experts)
    token_index, counts = _megatron_rows(seed, tokens, experts, experts, topk)
    g = torch.Generator().manual_seed(seed)
    p = dict(x=torch.randn(token_index.numel(), 16, generator=g),
             weight=torch.randn(experts, 16, 16, generator=g),
             counts=torch.tensor(counts), token_index=token_index)
    rows_y, _, _ = run_gemm2(p, splits=1, programs=3)
    row_start, _ = gemm2.expert_offsets(p["counts"], 16)
    dest = torch.empty(token_index.numel(), dtype=torch.int32)
    error = torch.zeros(1, dtype=torch.int32)
    passes = rt.route_rows(token_index, row_start, tokens, topk, error, dest)
    assert int(error) == 0 and passes.words == -(-experts // 32)
    y = _token_major(p, tokens, topk, gemm2.TokenPlaces(token_index, passes.marks,
                                                        passes.words, topk))
    assert torch.equal(y[dest.long()], rows_y) and not y.isnan().any()


def test_routing_table_from_counts_fills_the_offsets_even_without_rows_and_checks_sizes():
    packed, _ = gemm2.packed_offsets_host([0, 0, 0], 16, "cpu")
    filled = torch.full_like(packed, -9)
    error = torch.zeros(1, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int64)
    counts = torch.zeros(3, dtype=torch.int32)
    table = rt.launch_routing_table(none, counts, 5, 2, error, from_counts=(filled, 16))
    assert torch.equal(filled, packed) and torch.equal(table, torch.full((5, 2), -1))
    with pytest.raises(ValueError, match=r"packed must be \[3E \+ 2\]"):
        rt.launch_routing_table(none, counts, 5, 2, error, from_counts=(filled[:3], 16))


def test_routing_table_reads_int64_counts_and_flags_counts_that_miss_the_rows():
    """The counts a layer never brings to the host (int64, as `local_map.sum` gives them)
    give the host path's table and offsets; counts that do not sum to the rows, or a
    negative one, are recorded as ERR_COUNTS and clamped so no offset passes the rows."""
    token_index, counts = _megatron_rows(7, 24, 5, 5, 2)
    rows = token_index.numel()
    packed, _ = gemm2.packed_offsets_host(counts, 16, "cpu")
    error = torch.zeros(1, dtype=torch.int32)
    filled = torch.full_like(packed, -9)
    table = rt.launch_routing_table(token_index, torch.tensor(counts), 24, 2, error,
                                    from_counts=(filled, 16))
    assert int(error) == 0 and torch.equal(filled, packed)
    assert torch.equal(table, rt.combine_table(token_index, 24, 2))
    for bad in ([c + 3 for c in counts], [counts[0] - 1] + counts[1:],
                [-1] + counts[1:-1] + [counts[-1] + counts[0] + 1]):
        error = torch.zeros(1, dtype=torch.int32)
        filled = torch.full_like(packed, -9)
        rt.launch_routing_table(token_index, torch.tensor(bad), 24, 2, error,
                                from_counts=(filled, 16))
        assert int(error) >> 24 == rt.ERR_COUNTS, bad
        row_start, _, clamped = gemm2.unpack_offsets(filled, len(counts))
        assert int(row_start.max()) <= rows and int(clamped.min()) >= 0
        assert torch.equal(row_start[1:] - row_start[:-1], clamped)


def test_padded_rows_past_the_counts_are_in_no_segment_and_unchecked():
    """Rows past the counts' sum (the layer's bound of the rows under EP, padded with
    token 0, which breaks the order): with `padded` the table and the offsets are those
    of the counted rows alone and nothing is flagged; a sum past the rows still is."""
    token_index, counts = _megatron_rows(3, 40, 6, 3, 2)
    rows = token_index.numel()
    padded = torch.cat([token_index, torch.zeros(17, dtype=token_index.dtype)])
    packed, _ = gemm2.packed_offsets_host(counts, 16, "cpu")
    for dtype in (torch.int32, torch.int64):
        error = torch.zeros(1, dtype=torch.int32)
        filled = torch.full_like(packed, -9)
        table = rt.launch_routing_table(padded, torch.tensor(counts, dtype=dtype), 40, 2,
                                        error, from_counts=(filled, 16), padded=True)
        assert int(error) == 0 and torch.equal(filled, packed)
        assert torch.equal(table, rt.combine_table(token_index, 40, 2))
    error = torch.zeros(1, dtype=torch.int32)  # without `padded` the padding is an error
    rt.launch_routing_table(padded, torch.tensor(counts), 40, 2, error,
                            from_counts=(torch.full_like(packed, -9), 16))
    assert int(error) >> 24 == rt.ERR_COUNTS
    error = torch.zeros(1, dtype=torch.int32)
    over = [counts[0] + 18] + counts[1:]
    rt.launch_routing_table(padded, torch.tensor(over), 40, 2, error,
                            from_counts=(torch.full_like(packed, -9), 16), padded=True)
    assert int(error) >> 24 == rt.ERR_COUNTS and sum(over) > rows + 17
    with pytest.raises(ValueError, match="from_counts"):
        rt.launch_routing_table(padded, gemm2.expert_offsets_host(counts, 16, "cpu")[0], 40,
                                2, error, padded=True)


@pytest.mark.parametrize("local", [64, 24])
def test_routing_table_kernel_over_many_token_blocks(local):
    """64 experts: 64 tokens per program, so each program searches the window of its
    tokens in every expert's segment; tokens straddle the windows' edges."""
    token_index, counts = _megatron_rows(5, 300, 64, local, 6)
    row_start, _, _ = gemm2.expert_offsets_host(counts, 16, "cpu")
    error = torch.zeros(1, dtype=torch.int32)
    table = rt.launch_routing_table(token_index, row_start, 300, 6, error)
    assert torch.equal(table, rt.combine_table(token_index, 300, 6))
    assert int(error) == 0


@pytest.mark.parametrize("tokens", [40, 2000])
def test_routing_table_rows_crossing_few_or_many_segment_ends(tokens):
    """64 experts, 128 rows per program: with 2000 tokens a block of rows crosses a few
    segment ends (compared with those alone), with 40 it crosses dozens (compared with
    every end); both give the reference's table and inverse and flag nothing."""
    token_index, counts = _megatron_rows(11, tokens, 64, 64, 6)
    row_start, _, _ = gemm2.expert_offsets_host(counts, 16, "cpu")
    error = torch.zeros(1, dtype=torch.int32)
    dest = torch.full((token_index.numel(),), -7, dtype=torch.int32)
    table = rt.launch_routing_table(token_index, row_start, tokens, 6, error, dest)
    assert int(error) == 0
    assert torch.equal(table, rt.combine_table(token_index, tokens, 6))
    assert torch.equal(dest, token_major_rows(table, token_index.numel()))


@pytest.mark.parametrize("damage", ["swap", "out_of_range", "duplicate"])
def test_routing_table_kernel_flags_rows_out_of_megatron_order(damage):
    token_index, counts = _megatron_rows(3, 30, 6, 6, 2)
    bad = token_index.clone()
    if damage == "swap":
        bad[[0, 1]] = bad[[1, 0]]
    elif damage == "out_of_range":
        bad[-1] = 30
    else:
        bad[1] = bad[0]
    row_start, _, _ = gemm2.expert_offsets_host(counts, 16, "cpu")
    error = torch.zeros(1, dtype=torch.int32)
    rt.launch_routing_table(bad, row_start, 30, 2, error)
    assert int(error) >> 24 == rt.ERR_UNSORTED


def test_every_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter accepts code the compiler rejects; compile the real thing (sm_90)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this triton wheel has no ptxas ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parent.parent / "tools" / "compile_check.py"
    done = subprocess.run([sys.executable, str(tool)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 28, done.stdout  # every listed kernel and mode
    for name in ("gemm2", "gather_rs", "routing_table", "weighted_swiglu", "gather_rows",
                 "gated_add", "sum_rows"):
        assert f"ok {name}" in done.stdout or f"ok grouped_{name}" in done.stdout, name
    copies = {line.split(":")[0]: int(line.split(", ")[-1].split()[0])
              for line in done.stdout.splitlines()}  # "..., N async copies"
    # the pipelined item loops really gather by cp.async; the plain ones do not
    for layout in ("", " token_major"):
        assert copies[f"ok gather_rs slot_loop=True item_stages=1{layout}"] == 0
        assert copies[f"ok gather_rs slot_loop=True item_stages=2{layout}"] > 0


class _RecordedTriton:
    """Triton's compile (`warmup`) and JIT launch (`kernel[grid]`) of one kernel, recorded."""

    def __init__(self, jit_function):
        self.params = jit_function.params
        self.__name__ = "recorded"
        self.compiles, self.jit_launches, self.binary_launches = [], [], []

    def warmup(self, *args, grid, **meta):
        self.compiles.append(meta)
        launches = self.binary_launches

        class Binary:
            def _init_handles(self):
                pass

            def __getitem__(self, grid):
                return lambda *full_args: launches.append((grid, full_args))

        return Binary()

    def __getitem__(self, grid):
        return lambda *args, **meta: self.jit_launches.append((grid, args, meta))


def test_launch_cache_reuses_a_binary_only_for_the_same_specialization(monkeypatch):
    from triton.runtime.jit import JITFunction

    from megatron_overlap.kernels.launch_cache import LaunchCache

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a GPU process has
    # sum_partials as the GPU sees it: numel unspecialized, slot_stride specialized
    triton_side = _RecordedTriton(JITFunction(sp.sum_partials_kernel.fn,
                                              do_not_specialize=["numel"]))
    cache = LaunchCache(triton_side)
    recv, out = torch.zeros(2, 64, 32), torch.zeros(64, 32)
    ep = torch.zeros(1, dtype=torch.int32)  # the epoch word (parity 0)
    meta = dict(WORLD=2, BLOCK=4096, num_warps=8)
    cache.launch((4,), (recv, out, ep, 2048, 2048, 0), meta)
    cache.launch((4,), (recv, out, ep, 4096, 2048, 0), meta)  # numel: same binary
    assert len(triton_side.compiles) == 1 and not triton_side.jit_launches
    grid, full = triton_side.binary_launches[1]
    assert grid == (4, 1, 1) and full[3:] == (4096, 2048, 0, 2, 4096)  # constexprs last
    assert full[0] is recv and full[1] is out
    cache.launch((4,), (recv, out, ep, 2048, 1024, 0), meta)  # slot_stride is specialized
    cache.launch((4,), (recv, out, ep, 2048, 1024, 0), dict(meta, num_warps=4))
    cache.launch((4,), (recv.view(-1)[1:], out, ep, 2048, 1024, 0), meta)  # not 16-byte aligned
    cache.launch((4,), (recv, out, ep, 1 << 40, 1024, 0), meta)  # numel past int32
    cache.launch((4,), (recv, out, ep, 1 << 40, 1024, 0), dict(meta, WORLD=4))  # a constexpr
    assert len(triton_side.compiles) == 6
    monkeypatch.setattr(LaunchCache, "fast", False)  # every launch through kernel[grid]
    cache.launch((4,), (recv, out, ep, 2048, 2048, 0), meta)
    assert triton_side.jit_launches == [((4,), (recv, out, ep, 2048, 2048, 0), meta)]
    with pytest.raises(TypeError, match="expected the 6 non-constexpr"):
        cache.launch((4,), (recv, out, 2048), meta)


def test_launch_cache_keys_descriptors_on_layout_not_on_row_count(monkeypatch):
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    from megatron_overlap.kernels.launch_cache import LaunchCache

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = LaunchCache(_RecordedTriton(JITFunction(
        gemm2.grouped_gemm2_kernel.fn,
        do_not_specialize=["num_experts", "K", "num_splits", "dest_rows", "topk"])))
    w = torch.zeros(4 * 64, 32, dtype=torch.bfloat16)
    meta = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, EXPERTS_POW2=4, UPCAST=False,
                COL_ALIGN=16, FLATTEN=False, SCATTER=False, MARK_WORDS=1, FROM_DEST=False,
                num_warps=4, num_stages=3)

    def args(rows):
        x = torch.zeros(rows, 32, dtype=torch.bfloat16)
        y = torch.zeros(rows, 64, dtype=torch.bfloat16)
        idx = torch.zeros(5, dtype=torch.int32)
        return (TensorDescriptor.from_tensor(x, [16, 16]), TensorDescriptor.from_tensor(w, [16, 16]),
                y, idx, idx, idx, idx, idx, 4, 32, 64, 64, 1, rows, 1, 64, 1)

    for rows in (32, 48, 40):  # row counts that keep / break divisibility by 16
        cache.launch((8,), args(rows), meta)
    assert len(cache.kernel.compiles) == 2 and len(cache.kernel.binary_launches) == 3


@pytest.mark.parametrize("gluon", [False, True])
def test_launch_path_descriptors_equal_from_tensor_and_keep_no_tensor_alive(gluon,
                                                                         monkeypatch):
    """`launch_cache.descriptor` copies a template validated once per shape: the same
    fields and LaunchCache key as `from_tensor`, its base the new tensor, the alignment
    check kept, and no template holding a tensor (a reference would pin GPU memory)."""
    import gc
    import weakref

    from megatron_overlap.kernels.launch_cache import LaunchCache, _TEMPLATES, descriptor

    if gluon:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = (gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16),)
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor

        layout = ()
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (only the cache's key function is used)
    cache = LaunchCache(JITFunction(sp.sum_partials_kernel.fn))
    assert cache.active
    for rows in (48, 48, 40):  # the second call copies the first call's template
        t = torch.randn(rows, 32).to(torch.bfloat16)
        got = descriptor(TensorDescriptor, t, (16, 32), *layout)
        want = TensorDescriptor.from_tensor(t, [16, 32], *layout)
        assert got.base is t and type(got) is TensorDescriptor
        assert [getattr(got, f) for f in ("shape", "strides", "block_shape", "padding")] == \
            [getattr(want, f) for f in ("shape", "strides", "block_shape", "padding")]
        assert cache._key((got,), {}) == cache._key((want,), {}) is not None
    ref = weakref.ref(t)
    del t, got, want
    gc.collect()
    assert ref() is None and all(tmpl.base is None for tmpl in _TEMPLATES.values())
    with pytest.raises(ValueError, match="16-byte aligned"):
        descriptor(TensorDescriptor, torch.zeros(48 * 32 + 1, dtype=torch.bfloat16)[1:].view(48, 32),
                   (16, 32), *layout)


def _triton_specialization(cache, args):
    """What the installed Triton specializes these runtime arguments to (CPU-computable)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return tuple(native_specialize_impl(BaseBackend, a, False, not no_spec, True)
                 for a, no_spec in zip(args, cache.no_spec))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int32]),
                          st.integers(0, 3), st.integers(-3, 3), st.integers(0, 40),
                          st.sampled_from([1, 2, 16, 17, 32, 4096, 4097])),
                min_size=2, max_size=12))
def test_launch_cache_key_separates_everything_triton_specializes_on(draws):
    from triton.runtime.jit import JITFunction

    from megatron_overlap.kernels.launch_cache import LaunchCache

    # sum_partials' runtime arguments: three pointers, numel unspecialized, slot_stride
    # and parity_stride specialized
    cache = LaunchCache(JITFunction(sp.sum_partials_kernel.fn, do_not_specialize=["numel"]))
    base = torch.zeros(64, dtype=torch.float32)
    word = torch.zeros(1, dtype=torch.int32)
    seen = {}
    for dtype, offset, small, power, stride in draws:
        recv = torch.zeros(80, dtype=dtype)[offset:]  # offsets 1-3 break 16-byte alignment
        numel = small + (1 << power)  # crosses the int32 range for large powers
        args = (recv, base, word, numel, stride, stride)
        key = cache._key(args, {"WORLD": 2, "BLOCK": 4096})
        spec = _triton_specialization(cache, args)
        assert seen.setdefault(key, spec) == spec, (key, spec, seen[key])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=70), st.sampled_from([16, 64, 128]))
def test_host_offsets_equal_the_device_path_and_the_planner_row_tiles(counts, block_m):
    from megatron_overlap.planner import expert_row_tiles

    want_rows, want_tiles = gemm2.expert_offsets(torch.tensor(counts), block_m)
    row_start, tile_start, counts_dev = gemm2.expert_offsets_host(counts, block_m, "cpu")
    assert torch.equal(row_start, want_rows) and torch.equal(tile_start, want_tiles)
    assert counts_dev.tolist() == counts and row_start.dtype == torch.int32
    # numpy / torch integers from a caller give the same, and the planner's W_comp input
    packed, row_tiles = gemm2.packed_offsets_host(torch.tensor(counts), block_m, "cpu")
    assert packed.tolist() == want_rows.tolist() + want_tiles.tolist() + counts
    assert row_tiles == expert_row_tiles(counts, block_m) == int(want_tiles[-1])


class _Triton36Binary:
    """A compiled kernel as Triton 3.6 lays it out: `run` is the CUDA launcher."""

    def __init__(self, scratch=0):
        calls = self.raw_calls = []
        self.indexed = []
        self.function, self.packed_metadata = "function-handle", "packed-metadata"

        class CudaLauncher:
            global_scratch_size, profile_scratch_size = scratch, 0
            launch_cooperative_grid, launch_pdl = False, True

            def launch(self, *full):
                calls.append(full)

        self.run = CudaLauncher()

    def _init_handles(self):
        pass

    def __getitem__(self, grid):
        return lambda *full, stream=None: self.indexed.append((grid, full, stream))


@pytest.mark.parametrize("version, scratch, hooked, raw", [
    ("3.6.0", 0, False, True), ("3.7.1", 0, False, False), ("3.6.0", 64, False, False),
    ("3.6.0", 0, True, False)])
def test_raw_launch_passes_what_triton_36_runner_passes_and_only_there(
        monkeypatch, version, scratch, hooked, raw):
    import triton
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from megatron_overlap.kernels.launch_cache import LaunchCache

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton, "__version__", version)
    binary = _Triton36Binary(scratch)
    kernel = _RecordedTriton(JITFunction(sp.sum_partials_kernel.fn,
                                         do_not_specialize=["numel"]))
    kernel.warmup = lambda *args, grid, **meta: binary
    if hooked:
        hook = knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):
            monkeypatch.setattr(hook, "calls", [print])
        else:
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print)
    recv, out = torch.zeros(2, 64, 32), torch.zeros(64, 32)

    class Stream:
        cuda_stream = 1234

    ep = torch.zeros(1, dtype=torch.int32)
    LaunchCache(kernel).launch((4,), (recv, out, ep, 2048, 2048, 0),
                               dict(WORLD=2, BLOCK=4096, num_warps=8), stream=Stream())
    if raw:  # Triton 3.6's runner -> CudaLauncher.__call__ -> launch, hooks absent
        assert binary.raw_calls == [(4, 1, 1, 1234, "function-handle", False, True, None, None,
                                     "packed-metadata", None, None, None,
                                     recv, out, ep, 2048, 2048, 0, 2, 4096)]
        assert not binary.indexed
    else:
        assert not binary.raw_calls
        assert binary.indexed == [((4, 1, 1), (recv, out, ep, 2048, 2048, 0, 2, 4096), 1234)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("epoch", [None, 6, 7])
def test_sum_partials_adds_the_slots_in_rank_order_into_every_element(world, epoch):
    """... of the slots of the epoch's parity where one is given (the op's receive slots
    alternate by call; the epoch word is the device's, so replays alternate too)."""
    both = torch.randn(2, world, 40, 24, generator=torch.Generator().manual_seed(world))
    both = both.to(torch.bfloat16)
    out = torch.full((37, 24), float("nan"), dtype=torch.bfloat16)  # fewer rows than slots
    if epoch is None:
        recv = both[0]
        sp.launch_sum_partials(recv, out, world, block=256, num_warps=4)
    else:
        recv = both[epoch % 2]
        sp.launch_sum_partials(both[0], out, world, block=256, num_warps=4,
                                epoch=torch.tensor([epoch], dtype=torch.int32),
                                parity_stride=both[0].numel())
    want = sp.sum_partials_reference(recv, 37)
    assert not out.isnan().any()
    # one bf16 rounding of the fp32 sum (the interpreter's float -> bf16 cast may round
    # differently from torch's by one unit in the last place)
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=0)


def test_layout_arguments_of_wrong_type_or_size_raise_clear_errors():
    from megatron_overlap.ops.config import GPU_TILES, TileConfig

    p = routed_problem(0, 1, tokens=20, experts=3, topk=2, ffn=16, hidden=32)
    x, w = p["x"], p["weight"]
    row_start, tile_start = gemm2.expert_offsets(p["counts"], 16)
    ready = torch.zeros(8, dtype=torch.int32)
    y = torch.empty(x.shape[0], 32, dtype=x.dtype)
    marks = torch.zeros(20 * 2, dtype=torch.int32)
    tok = p["token_index"]
    for bad, match in ((gemm2.TokenPlaces(tok[:3], marks, 1, 2), "places.token_index"),
                       (gemm2.TokenPlaces(tok.float(), marks, 1, 2), "places.token_index"),
                       (gemm2.TokenPlaces(tok, marks, 2, 2), "places.words"),
                       (gemm2.TokenPlaces(tok, marks, 1, 0), "places.topk"),
                       (gemm2.TokenPlaces(tok, marks[:19], 1, 2), "places.marks"),
                       (gemm2.TokenPlaces(tok, marks.long(), 1, 2), "places.marks"),
                       (gemm2.TokenPlaces(tok, marks, 1, 2, tok[:3].int()), "places.dest"),
                       (gemm2.TokenPlaces(tok, marks, 1, 2, tok.long()), "places.dest")):
        with pytest.raises(ValueError, match=match):
            gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, ready, splits=1,
                                       programs=2, block_m=16, block_n=16, block_k=16,
                                       places=bad)
    for bad in (torch.zeros(x.shape[0], dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="dest must be"):
            rt.launch_routing_table(p["token_index"], row_start, 20, 2,
                                    torch.zeros(1, dtype=torch.int32), bad)
    with pytest.raises(ValueError, match="comm_slot_loop must be True"):
        TileConfig(128, 128, 64, 4, 3, 256, 1024, 32, comm_slot_loop=False)
    assert not TileConfig(128, 128, 64, 4, 3, 256, 1024, 32, comm_slot_loop=False,
                          token_major=False).token_major
    assert GPU_TILES.token_major and GPU_TILES.comm_slot_loop
    out, _, _, _, launch = gather_single_rank(p, y, tile_start, 1, 2)
    with pytest.raises(ValueError, match="one slot at a time"):
        grs.launch_gather_rs(*launch["args"], token_major=True, slot_loop=False,
                             **launch["kwargs"])


def test_auto_falls_back_to_triton_with_a_warning_where_gluon_cannot_build(monkeypatch):
    """A Hopper GPU whose Triton cannot compile the Gluon GEMM2 gets the Triton kernel
    and one RuntimeWarning, not a compile error inside the op's first launch."""
    from megatron_overlap.kernels import gemm2, gemm2_ws

    def broken(device_index):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(gemm2_ws, "compile_probe", broken)
    gemm2._gluon_runs_on.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Gluon GEMM2 does not build"):
            assert not gemm2._gluon_runs_on(0)
        monkeypatch.setattr(gemm2_ws, "compile_probe", lambda device_index: None)
        gemm2._gluon_runs_on.cache_clear()
        assert gemm2._gluon_runs_on(0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (10, 0))
        gemm2._gluon_runs_on.cache_clear()
        assert not gemm2._gluon_runs_on(0)  # wgmma is sm_90 only
    finally:
        gemm2._gluon_runs_on.cache_clear()


def test_gather_binaries_ask_the_driver_for_the_largest_shared_carveout(monkeypatch):
    """GatherRS CTAs share SMs with GEMM2's (tail helpers, the shared placement), which an
    SM allows only under one L1/shared split: every GatherRS binary the launch cache loads
    asks for the largest carveout (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT =
    9, 100%); a driver error is raised, and without an NVIDIA driver nothing is asked."""
    from megatron_overlap import cuda_driver
    from megatron_overlap.kernels import launch_cache as lc

    calls = []

    class FakeDriver:
        rc = 0

        def cuFuncSetAttribute(self, function, attribute, value):
            calls.append((function.value, attribute, value))
            return self.rc

    class Binary:
        function = 1234

    driver = FakeDriver()
    monkeypatch.setattr(cuda_driver, "libcuda", lambda: driver)
    lc.prefer_max_shared(Binary())
    assert calls == [(1234, 9, 100)]
    driver.rc = 1
    with pytest.raises(RuntimeError, match="PREFERRED_SHARED_MEMORY_CARVEOUT"):
        lc.prefer_max_shared(Binary())
    monkeypatch.setattr(cuda_driver, "libcuda", lambda: None)
    lc.prefer_max_shared(Binary())  # no driver: no call, no error
    assert len(calls) == 2
    assert grs._GATHER_RS.max_shared and not gemm2._GEMM2.max_shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(37, 48), (5, 24), (130, 16)])
def test_weighted_swiglu_matches_fp64_and_writes_every_element(dtype, rows, k):
    """K = 24 and 48 are no power of two (a masked column block); 130 rows span blocks."""
    g = torch.Generator().manual_seed(rows * k)
    inter = (3 * torch.randn(rows, 2 * k, generator=g)).to(dtype)
    probs = torch.rand(rows, generator=g)
    out = torch.full((rows, k), float("nan"), dtype=dtype)  # poisoned
    assert swiglu.weighted_swiglu(inter, probs, out=out) is out
    assert out.shape == (rows, k) and out.dtype == dtype and not out.isnan().any()
    gate, up = inter.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up * probs.double()[:, None]
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert rel_err(out.double(), want) < tol
    ref = swiglu.weighted_swiglu_reference(inter, probs).double()
    assert rel_err(out.double(), ref) < tol


def test_weighted_swiglu_takes_no_rows_and_refuses_bad_shapes():
    assert swiglu.weighted_swiglu(torch.zeros(0, 8), torch.zeros(0)).shape == (0, 4)
    with pytest.raises(ValueError, match=r"inter must be \[T, 2K\]"):
        swiglu.weighted_swiglu(torch.zeros(4, 7), torch.zeros(4))
    with pytest.raises(ValueError, match="probs must be"):
        swiglu.weighted_swiglu(torch.zeros(4, 8), torch.zeros(5))
    with pytest.raises(ValueError, match="floating point"):
        swiglu.weighted_swiglu(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4))
    with pytest.raises(ValueError, match="out must be contiguous"):
        swiglu.weighted_swiglu(torch.zeros(4, 8), torch.zeros(4), out=torch.zeros(4, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 48), (3, 5, 24), (130, 64)])
def test_gated_shared_add_matches_fp64_in_place_and_touches_every_element(dtype, shape):
    """H = 24 and 48 are no power of two (a masked column block); 130 rows span blocks;
    [3, 5, 24] is Megatron's [S, B, H] with a [S, B, 1] logit."""
    g = torch.Generator().manual_seed(sum(shape))
    routed = torch.randn(shape, generator=g).to(dtype)
    shared = (2 * torch.randn(shape, generator=g)).to(dtype)
    logit = (3 * torch.randn(*shape[:-1], 1, generator=g)).to(dtype)
    want = routed.double() + torch.sigmoid(logit.double()) * shared.double()
    ref = gated_add.add_gated_shared_reference(routed, shared, logit).double()
    out = routed.clone()
    assert gated_add.add_gated_shared_(out, shared, logit) is out
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert out.dtype == dtype and rel_err(out.double(), want) < tol
    assert rel_err(out.double(), ref) < tol
    poisoned = torch.full(shape, float("nan"), dtype=dtype)  # every element is read and written
    gated_add.add_gated_shared_(poisoned, shared, logit)
    assert poisoned.isnan().all()


def test_gated_shared_add_takes_no_tokens_and_refuses_bad_inputs():
    empty = torch.zeros(0, 8)
    assert gated_add.add_gated_shared_(empty, torch.zeros(0, 8), torch.zeros(0)) is empty
    with pytest.raises(ValueError, match="one shape"):
        gated_add.add_gated_shared_(torch.zeros(4, 8), torch.zeros(4, 4), torch.zeros(4))
    with pytest.raises(ValueError, match="share a floating dtype"):
        gated_add.add_gated_shared_(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16),
                                    torch.zeros(4))
    with pytest.raises(ValueError, match="one floating value per token"):
        gated_add.add_gated_shared_(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(5))
    with pytest.raises(ValueError, match="contiguous"):
        gated_add.add_gated_shared_(torch.zeros(8, 4).t(), torch.zeros(4, 8), torch.zeros(4))
    assert [gated_add.block_shape(h) for h in (2048, 5120, 1536, 64, 24)] == [
        (8, 512), (8, 512), (8, 512), (64, 64), (256, 16)]


@pytest.mark.parametrize("valid", [0, 1, 37, 129, 200])
def test_swiglu_with_a_device_row_count_computes_those_rows_only(valid):
    """Rows past `valid_rows` keep out's contents (the padding of a bounded permute)."""
    g = torch.Generator().manual_seed(valid)
    inter = torch.randn(130, 48, generator=g)
    probs = torch.rand(130, generator=g)
    out = torch.full((130, 24), float("nan"))  # poisoned
    swiglu.weighted_swiglu(inter, probs, out=out, valid_rows=torch.tensor([valid]))
    n = min(valid, 130)
    want = swiglu.weighted_swiglu_reference(inter[:n], probs[:n]).double()
    assert not n or rel_err(out[:n].double(), want) < 1e-5
    assert not out[:n].isnan().any() and out[n:].isnan().all()
    with pytest.raises(ValueError, match="valid_rows must be one integer"):
        swiglu.weighted_swiglu(inter, probs, valid_rows=torch.tensor([1.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("valid,h", [(0, 64), (5, 24), (61, 64), (200, 40)])
def test_gather_rows_copies_the_rows_below_the_device_count_only(dtype, valid, h):
    """H = 24 and 40 are no power of two (a masked column block); 61 rows span blocks
    (BLOCK_R = 64 at H = 64 would hold them all: 200 index rows make four)."""
    g = torch.Generator().manual_seed(valid + h)
    src = torch.randn(50, h, generator=g).to(dtype)
    index = torch.randint(0, 50, (200,), generator=g)
    count = torch.tensor([valid])
    out = gather_rows.gather_rows(src, index, count)
    n = min(valid, 200)
    assert out.shape == (200, h) and out.dtype == dtype
    assert torch.equal(out[:n], src[index[:n]])  # a copy: the same bits
    assert torch.equal(gather_rows.gather_rows_reference(src, index, count), src[index[:n]])
    poisoned = torch.full((200, h), float("nan"), dtype=dtype)
    gather_rows._GATHER_ROWS.launch(  # the rows past the count are not written
        (triton.cdiv(200, gather_rows.block_shape(h)[0]),
         triton.cdiv(h, gather_rows.block_shape(h)[1])),
        (src, index, count, poisoned, 200),
        dict(H=h, BLOCK_R=gather_rows.block_shape(h)[0], BLOCK_H=gather_rows.block_shape(h)[1],
             num_warps=4))
    assert torch.equal(poisoned[:n], src[index[:n]]) and poisoned[n:].isnan().all()


def test_gather_rows_refuses_bad_inputs():
    src, index = torch.zeros(4, 8), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"src must be \[N, H\]"):
        gather_rows.gather_rows(torch.zeros(4), index, torch.tensor([1]))
    with pytest.raises(ValueError, match="index must be int64"):
        gather_rows.gather_rows(src, index.int(), torch.tensor([1]))
    with pytest.raises(ValueError, match="valid must be one integer"):
        gather_rows.gather_rows(src, index, torch.tensor([1, 2]))
    assert gather_rows.gather_rows(src, index[:0], torch.tensor([0])).shape == (0, 8)


def test_swiglu_block_divides_the_expert_widths_of_the_models():
    assert [swiglu.block_shape(k) for k in (1408, 704, 512, 256, 24)] == [
        (32, 128), (64, 64), (16, 256), (16, 256), (256, 16)]
