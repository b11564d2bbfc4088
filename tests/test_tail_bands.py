"""Token bands of the last split (kernels/tail_bands.py): the band order, what GEMM2
publishes per band, and the op's bits, which the bands must not change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_harness import run_ranks
from megatron_overlap.kernels import gemm2
from megatron_overlap.kernels.tail_bands import MAX_TAIL_BANDS, tail_order, tail_order_reference
from megatron_overlap.ops import OverlapConfig, OverlapTimeoutError, gemm2_gather_rs
from megatron_overlap.ops.config import INTERPRET_TILES
from routing_cases import fp64_rank_partial, rel_err, routed_problem

INTERP = OverlapConfig(backend="interpret")


def sorted_rows(tokens: int, experts: int, topk: int, seed: int, tokens_per_rank=None):
    """token_index in Megatron's permutation order and the counts, random top-k."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    rows = sorted((e, t) for t in range(tokens) for e in picks[t].tolist())
    counts = [sum(1 for e, _ in rows if e == x) for x in range(experts)]
    return torch.tensor([t for _, t in rows], dtype=torch.int64), counts


@pytest.mark.parametrize("tokens,experts,topk,block_m,block_tm,per_rank", [
    (37, 5, 3, 4, 2, 37), (64, 4, 2, 8, 4, 32), (50, 7, 1, 4, 3, 25)])
def test_the_band_order_matches_the_reference_tile_by_tile(tokens, experts, topk, block_m,
                                                           block_tm, per_rank):
    token_index, counts = sorted_rows(tokens, experts, topk, seed=tokens)
    row_start, tile_start = gemm2.expert_offsets(torch.tensor(counts), block_m)
    for bands in (1, 2, 3, 5):
        got = tail_order(token_index, row_start, tile_start, tokens_per_rank=per_rank,
                         bands=bands, block_m=block_m, block_tm=block_tm)
        want = tail_order_reference(token_index, counts, tokens_per_rank=per_rank,
                                    bands=bands, block_m=block_m, block_tm=block_tm)
        for name in ("order", "band", "band_start"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (bands, name)
        row_tiles = int(tile_start[-1])
        assert int(got.band_start[-1]) == row_tiles  # every real tile is in a band
        assert sorted(got.order[:row_tiles].tolist()) == list(range(row_tiles))
        assert got.band[:row_tiles].tolist() == sorted(got.band[:row_tiles].tolist())


def test_gemm2_publishes_each_band_of_the_last_split_to_its_own_word():
    token_index, counts = sorted_rows(40, 4, 2, seed=1)
    t = INTERPRET_TILES
    row_start, tile_start = gemm2.expert_offsets(torch.tensor(counts), t.block_m)
    tail = tail_order(token_index, row_start, tile_start, tokens_per_rank=40, bands=3,
                      block_m=t.block_m, block_tm=4)
    x = torch.randn(token_index.numel(), 32)
    w = torch.randn(4, 48, 32)
    y = torch.full((token_index.numel(), 48), float("nan"))
    ready = torch.zeros(8, dtype=torch.int32)
    gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, ready, splits=2, programs=5,
                               block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                               upcast=True, tail=tail)
    row_tiles, cols = int(tile_start[-1]), -(-24 // t.block_n)
    per_band = (tail.band_start[1:] - tail.band_start[:-1]).tolist()
    assert ready.tolist() == [row_tiles * cols] + [n * cols for n in per_band] + [0] * 4
    want = torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(
        zip(row_start[:-1].tolist(), row_start[1:].tolist()))])
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)  # every row, every column


@pytest.mark.parametrize("probs", [False, True])
def test_the_op_gives_the_same_bits_for_every_band_count(probs):
    p = routed_problem(0, 1, tokens=45, experts=5, topk=3, ffn=24, hidden=40,
                       dtype=torch.float32)
    args = (p["x"], p["weight"], p["counts"], p["token_index"], 45, 3,
            p["probs"] if probs else None)
    first = gemm2_gather_rs(*args, config=INTERP)
    assert rel_err(first, fp64_rank_partial(p, 45, with_probs=probs)) < 1e-5
    for bands, splits, comm_ctas in ((2, 1, 3), (3, 2, 1), (4, 3, 7), (MAX_TAIL_BANDS, 2, 2)):
        cfg = dataclasses.replace(INTERP, tail_bands=bands)
        out, plan = gemm2_gather_rs(*args, config=cfg, splits=splits, comm_ctas=comm_ctas,
                                    return_plan=True)
        assert torch.equal(out, first), (bands, splits, comm_ctas)


def _two_ranks_with_bands(rank: int, world: int) -> None:
    import torch.distributed as dist

    p = routed_problem(rank, world, tokens=24, experts=4, topk=2, ffn=16, hidden=32,
                       dtype=torch.float32)
    args = (p["x"], p["weight"], p["counts"], p["token_index"], 24, 2, None, dist.group.WORLD)
    plain = gemm2_gather_rs(*args, config=INTERP)
    banded = gemm2_gather_rs(*args, config=dataclasses.replace(INTERP, tail_bands=3),
                             splits=2)
    assert torch.equal(plain, banded)
    reference = gemm2_gather_rs(*args, config=OverlapConfig(backend="reference"))
    assert float((banded - reference).norm() / reference.norm()) < 1e-5


def test_two_ranks_give_the_same_bits_with_bands():
    run_ranks(2, _two_ranks_with_bands)


def test_a_band_that_never_fills_times_out_naming_its_word(monkeypatch):
    from megatron_overlap.kernels import tail_bands

    p = routed_problem(0, 1, tokens=20, experts=2, topk=1, ffn=16, hidden=32)
    cfg = OverlapConfig(backend="interpret", max_spins=50, tail_bands=2)
    real = tail_bands._sorted

    def one_tile_short(band, bands):  # band 1 expects one tile more than GEMM2 stores
        found = real(band, bands)
        found.band_start[2:] += 1
        return found

    monkeypatch.setattr(tail_bands, "_sorted", one_tile_short)
    with pytest.raises(OverlapTimeoutError, match=r"waiting for readiness word 2"):
        gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 20, 1,
                        config=cfg, splits=2)


def test_tail_bands_is_validated():
    for bad in (0, MAX_TAIL_BANDS + 1, 2.0, True):
        with pytest.raises(ValueError, match="tail_bands must be an int"):
            OverlapConfig(tail_bands=bad)
