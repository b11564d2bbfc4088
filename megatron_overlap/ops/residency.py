"""How many CTAs of each compiled kernel fit one SM, read from the binaries themselves.

The planner's o_comp / o_comm (CTAs per SM of GEMM2 and of GatherRS) and the shared
placement's fit (o_comp GEMM2 CTAs and one GatherRS CTA on every SM) depend on the
registers, warps and shared memory of the kernels as compiled for this device and
Triton, so they are read from a compile of each (no launch), once per kernel family.
"""

from __future__ import annotations

import torch

from ..kernels import gather_rs as grs
from ..kernels import gemm2
from ..kernels.gemm2_layout import TokenPlaces
from ..planner import co_resident, resident_ctas
from .config import TileConfig
from .fp8 import OPERAND_DTYPE, compile_scales


def compiled_occupancies(device: torch.device, flags: tuple, t: TileConfig, comm_tm: int,
                         comm_tn: int, slots: int, fp8: str | None = None
                         ) -> tuple[int, int, str | None, dict]:
    """(o_comp, o_comm, misfit, resources) of the GEMM2 and GatherRS binaries for tiles t,
    a comm tile of comm_tm x comm_tn and `slots` table slots on a CUDA device: misfit is
    None if o_comp GEMM2 CTAs and one GatherRS CTA fit one SM together, else the resource
    that does not; resources their registers, shared memory, spills and warps.
    `flags`: the buffer's (ready, done, error) words, arguments of the compiles. `fp8`:
    GEMM2 on FP8 operands of that scaling kind: the FP8 kernel is compiled, so o_comp is
    its own."""
    ready, done, error = flags
    dtype = OPERAND_DTYPE if fp8 else torch.bfloat16
    x = torch.empty(t.block_m, t.block_k, dtype=dtype, device=device)
    w = torch.empty(1, t.block_n, t.block_k, dtype=dtype, device=device)
    y = torch.empty(t.block_m, t.block_n, dtype=torch.bfloat16, device=device)
    scales = compile_scales(fp8, t.block_m, t.block_k, t.block_n, device) if fp8 else None
    idx = torch.zeros(2, dtype=torch.int32, device=device)
    marks = torch.zeros(t.block_m, dtype=torch.int32, device=device)  # (one expert: one word)
    places = (TokenPlaces(marks, marks, 1, 1, marks)
              if t.token_major else None)  # (the kernel variant the op will launch)
    gk = gemm2.launch_grouped_gemm2(
        x, w, y, idx, idx, ready, splits=1, programs=1, block_m=t.block_m,
        block_n=t.block_n, block_k=t.block_k, num_warps=t.gemm_warps,
        num_stages=t.gemm_stages, flatten=t.gemm_flatten, warmup=True, places=places,
        impl=t.gemm_impl, maxnreg=t.gemm_maxnreg, scales=scales)
    table = torch.zeros(1, slots, dtype=torch.int32, device=device)
    ptrs = torch.zeros(1, dtype=torch.int64, device=device)
    ck = grs.launch_gather_rs(
        y, table, None, ptrs, ptrs, ready, done, error, idx,
        tokens_per_rank=1, splits=1, rank=0, world=1, gemm_col_tiles=1, epoch=done,
        max_spins=1, partial_like=y, dst_slot_stride=0, dst_row_stride=1, programs=1,
        block_tm=comm_tm, block_tn=comm_tn, num_warps=t.comm_warps,
        item_stages=t.comm_stages, slot_loop=t.comm_slot_loop, warmup=True,
        token_major=t.token_major, maxnreg=t.comm_maxnreg)
    occ, resources = [], {}
    for name, k in (("gemm2", gk), ("gather_rs", ck)):
        k._init_handles()  # (warps from the binary: a warp-specialized one has more)
        occ.append(resident_ctas(k.n_regs, k.metadata.num_warps * 32,
                                 k.metadata.shared).ctas_per_sm)
        resources[name] = dict(registers=k.n_regs, shared=k.metadata.shared,
                               spills=k.n_spills, ctas_per_sm=occ[-1],
                               warps=k.metadata.num_warps)
    misfit = co_resident([(k.n_regs, k.metadata.num_warps * 32, k.metadata.shared, count)
                          for k, count in ((gk, occ[0]), (ck, 1))])
    return occ[0], occ[1], misfit, resources
