"""Token bands of the last split on a real GPU (device machine): `pytest -m gpu
tests/test_tail_bands_gpu.py`. The Gluon GEMM2 has no interpreter path, and only here do
GEMM2 and GatherRS run at once, GatherRS waiting band by band while GEMM2 publishes."""

import dataclasses
import faulthandler
import sys

import pytest
import torch

from megatron_overlap.kernels import gemm2
from megatron_overlap.kernels.tail_bands import tail_order, tail_order_reference
from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs
from routing_cases import routed_problem

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _stacks_if_stuck():
    # a GPU hang would block the host in a sync: print where, then let the caller's
    # timeout end the run
    faulthandler.dump_traceback_later(45, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def _problem(seed=3):
    return routed_problem(0, 1, tokens=2048, experts=32, topk=8, ffn=512, hidden=1024,
                          seed=seed, device="cuda")


def test_the_band_order_on_the_gpu_matches_the_reference():
    p = _problem()
    counts = p["counts"].tolist()
    row_start, tile_start = gemm2.expert_offsets(p["counts"].cuda(), 128)
    got = tail_order(p["token_index"], row_start, tile_start, tokens_per_rank=2048, bands=4,
                     block_m=128, block_tm=4)
    want = tail_order_reference(p["token_index"].cpu(), counts, tokens_per_rank=2048,
                                bands=4, block_m=128, block_tm=4)
    for name in ("order", "band", "band_start"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.parametrize("impl", ["triton", "gluon", "gluon_inline_publish"])
def test_each_gemm2_publishes_every_band_and_writes_every_row(impl):
    p = _problem()
    x, w = p["x"], p["weight"]
    row_start, tile_start = gemm2.expert_offsets(p["counts"].cuda(), 128)
    tail = tail_order(p["token_index"], row_start, tile_start, tokens_per_rank=2048,
                      bands=4, block_m=128, block_tm=4)
    dest = torch.arange(x.shape[0], dtype=torch.int32, device="cuda")
    y = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
    ready = torch.zeros(16, dtype=torch.int32, device="cuda")
    gemm2.launch_grouped_gemm2(x, w, y, row_start, tile_start, ready, splits=2,
                               programs=264, block_m=128, block_n=128, block_k=64,
                               dest=dest, impl=impl, tail=tail)
    torch.cuda.synchronize()
    ref = gemm2.grouped_gemm2_reference(x, w, p["counts"].tolist()).float()
    assert not torch.isnan(y).any()
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
    row_tiles = int(tile_start[-1])
    per_band = (tail.band_start[1:] - tail.band_start[:-1]).tolist()
    assert ready.tolist()[:5] == [row_tiles * 4] + [n * 4 for n in per_band]


def test_the_op_with_bands_gives_the_bits_of_one_band():
    p = _problem(seed=4)
    args = (p["x"], p["weight"], p["counts"].tolist(), p["token_index"], 2048, 8)
    base = OverlapConfig(wait_timeout_s=5.0, sync_errors=True)
    first = gemm2_gather_rs(*args, config=base)
    for bands, splits in ((2, 2), (4, 1), (8, 2)):
        out = gemm2_gather_rs(*args, config=dataclasses.replace(base, tail_bands=bands),
                              splits=splits)
        assert torch.equal(out, first), (bands, splits)
