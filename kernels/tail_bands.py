"""Token bands of the last split: GEMM2's last split in band order, so GatherRS combines
it band by band while GEMM2 still computes the later bands.

Without bands the last split becomes ready only when GEMM2's last tile is stored, and its
whole combine runs after GEMM2 (the op's tail). With B bands, token t (t_local = t mod
M_d, M_d tokens per destination rank) is in band

    band(t) = (t_local // TM) * B // ceil(M_d / TM)

(TM: GatherRS's tokens per item, so an item lies in one band). A GEMM2 row tile is in the
band of its earliest row; GEMM2 takes the last split's row tiles in band order (a stable
sort: expert order inside a band) and publishes each tile to the readiness word of its
band. A band's tokens are complete once every band up to it is, since a tile holding a
row of band b is in band <= b: GatherRS waits for bands 0..b before an item of band b.
The tail is then the combine of the last band (1/B of the last split).

Worked example: M_d = 8 tokens, TM = 2, B = 2: token blocks {0,1}, {2,3} are band 0 and
{4,5}, {6,7} band 1; an expert's rows with tokens 1, 3, 4, 6 and TM(GEMM2) = 2 make two
row tiles, of bands 0 (tokens 1, 3) and 1 (tokens 4, 6).

This file: the kernel that finds each row tile's band, its host wrapper (the band order
and each band's first tile: `TailOrder`) and a pure-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm2_layout import next_pow2

#: bands the readiness words hold room for beside the splits' (ops/config.py checks)
MAX_TAIL_BANDS = 16


@triton.jit(do_not_specialize=["num_experts", "tokens_per_rank", "token_blocks", "bands"])
def tile_bands_kernel(token_ptr, row_start_ptr, tile_start_ptr, band_ptr, num_experts,
                      tokens_per_rank, token_blocks, bands, BLOCK_M: tl.constexpr,
                      BLOCK_TM: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """band_ptr[r] = the least band of row tile r's tokens; `bands` past the row tiles."""
    tile = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    tile_end = tl.load(tile_start_ptr + 1 + experts, mask=known, other=2147483647)
    real = tile < tl.load(tile_start_ptr + num_experts)
    expert = tl.minimum(tl.sum((tile_end <= tile).to(tl.int32)), num_experts - 1)
    first_row = tl.load(row_start_ptr + expert) \
        + (tile - tl.load(tile_start_ptr + expert)) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    ok = real & (rows < tl.load(row_start_ptr + expert + 1))
    token = tl.load(token_ptr + rows, mask=ok, other=0).to(tl.int32)
    band = ((token % tokens_per_rank) // BLOCK_TM) * bands // token_blocks
    tl.store(band_ptr + tile, tl.min(tl.where(ok, band, bands), axis=0))


@dataclass(frozen=True)
class TailOrder:
    """The last split's row tiles in band order, what GEMM2 and GatherRS read.

    order: [R_max] int64, the row tile at each position of the last split.
    band: [R_max] int32, the band of that tile (B past the real row tiles).
    band_start: [B + 1] int32, the first position of each band (band_start[B]: the row
        tiles in all); band b has band_start[b + 1] - band_start[b] row tiles.
    bands: B.
    """

    order: torch.Tensor
    band: torch.Tensor
    band_start: torch.Tensor
    bands: int


def max_row_tiles(rows: int, experts: int, block_m: int) -> int:
    """sum_e ceil(M_e / TM) <= ceil(T / TM) + E, whatever the counts."""
    return -(-rows // block_m) + experts


def tail_order(token_index: torch.Tensor, row_start: torch.Tensor, tile_start: torch.Tensor,
               *, tokens_per_rank: int, bands: int, block_m: int, block_tm: int) -> TailOrder:
    """The band order of the row tiles (no host sync: the row tiles are counted on the
    device; positions past them hold the sentinel band B)."""
    if not 1 <= bands <= MAX_TAIL_BANDS:
        raise ValueError(f"bands must be in [1, {MAX_TAIL_BANDS}], got {bands}")
    experts = row_start.numel() - 1
    slots = max_row_tiles(token_index.numel(), experts, block_m)
    band = torch.empty(slots, dtype=torch.int32, device=token_index.device)
    token_blocks = triton.cdiv(tokens_per_rank, block_tm)
    tile_bands_kernel[(slots,)](token_index, row_start, tile_start, band, experts,
                                tokens_per_rank, token_blocks, bands, BLOCK_M=block_m,
                                BLOCK_TM=block_tm, EXPERTS_POW2=next_pow2(experts))
    return _sorted(band, bands)


def _sorted(band: torch.Tensor, bands: int) -> TailOrder:
    band, order = torch.sort(band, stable=True)
    edges = torch.arange(bands + 1, dtype=torch.int32, device=band.device)
    band_start = torch.searchsorted(band, edges, out_int32=True)
    return TailOrder(order, band, band_start, bands)


def tail_order_reference(token_index, counts: list[int], *, tokens_per_rank: int, bands: int,
                         block_m: int, block_tm: int) -> TailOrder:
    """Pure torch, host counts: the same order, tile by tile."""
    token_blocks = -(-tokens_per_rank // block_tm)
    tile_band, first = [], 0
    for count in counts:
        for start in range(first, first + count, block_m):
            tokens = token_index[start:min(start + block_m, first + count)].long()
            tile_band.append(int((((tokens % tokens_per_rank) // block_tm) * bands
                                  // token_blocks).min()))
        first += count
    slots = max_row_tiles(token_index.numel(), len(counts), block_m)
    band = torch.full((slots,), bands, dtype=torch.int32)
    band[:len(tile_band)] = torch.tensor(tile_band, dtype=torch.int32)
    return _sorted(band, bands)
