"""Decision cache: repeated layers and steps pay one dictionary look-up (stdlib only)."""

from __future__ import annotations

from typing import Callable

from .calibration import Calibration
from .inputs import DeviceSpec, KernelSpec, Sizes, Workload, plainly_valid
from .quantities import (comm_col_tiles, comm_row_tiles, expert_row_tiles, service_ratio,
                         split_col_tiles)
from .search import Plan, plan, plan_tiles, routing_plan, routing_t


class PlanCache:
    """`plan` memoized on everything that changes the answer, for one kernel and device.

    The key holds tile counts, not raw counts: two routings with the same
    sum_e ceil(M_e / TM) get the same decision, since W_comp is all the model reads of
    them. Kernel, device and calibration are bound at construction, so a key is a few
    ints and hashing it costs well under a microsecond.
    """

    def __init__(self, kernel: KernelSpec, device: DeviceSpec, calib: Calibration,
                 max_entries: int = 4096):
        self.kernel, self.device, self.calib = kernel, device, calib
        self.max_entries = max_entries
        self._plans: dict[tuple, Plan] = {}
        #: per sizes but M (N, K, D, L, g, k, local k): what `decide_tiles` reuses
        self._sized: dict[tuple, tuple[int, int, float]] = {}
        self.hits = 0
        self.misses = 0

    def decide(
        self, tokens: int, hidden: int, ffn: int, world: int, splits: int,
        expert_counts, groups: int = 1, comm_ctas: int | None = None, enabled: bool = True,
        topk: int | None = None, local_topk: float | None = None,
    ) -> Plan:
        """The plan for these sizes; `expert_counts` is any sequence of ints (M_e)."""
        if min(expert_counts, default=0) < 0:
            raise ValueError(f"Workload.expert_counts must be non-negative, got {expert_counts}")
        m_tiles = expert_row_tiles(expert_counts, self.kernel.tile_m)
        key = (m_tiles, tokens, hidden, ffn, world, splits, groups, topk, local_topk,
               comm_ctas, enabled)
        found = self._plans.get(key)
        if found is None:
            workload = Workload(tokens, hidden, ffn, world, splits, expert_counts, groups,
                                topk, local_topk)
            found = self._store(key, plan(workload, self.kernel, self.device, self.calib,
                                          comm_ctas=comm_ctas, enabled=enabled))
        else:
            self.hits += 1
        return found

    def decide_tiles(
        self, row_tiles: int, tokens: int, hidden: int, ffn: int, world: int, splits: int,
        local_experts: int, groups: int = 1, comm_ctas: int | None = None,
        enabled: bool = True, topk: int | None = None, local_topk: float | None = None,
    ) -> Plan:
        """The plan from sum_e ceil(M_e / TM) directly, for callers that hold it already.

        On a miss the tiles stand for one expert of row_tiles * TM rows: the same sum,
        so the same W_comp and the same plan for any `local_experts` (which the model
        never reads), without an O(E) list to build, validate and reduce again.
        """
        key = (row_tiles, tokens, hidden, ffn, world, splits, groups, topk, local_topk,
               comm_ctas, enabled)
        found = self._plans.get(key)
        if found is None:
            sizes = (tokens, hidden, ffn, world, splits, groups, topk, local_topk)
            found = self._store(key, plan_tiles(*self._tiles(row_tiles, sizes, local_experts),
                                                splits, self.kernel, self.device, self.calib,
                                                comm_ctas, enabled))
        else:
            self.hits += 1
        return found

    def predictor(
        self, hidden: int, ffn: int, world: int, splits: int, local_experts: int,
        groups: int = 1, comm_ctas: int | None = None, enabled: bool = True,
        topk: int | None = None, local_topk: float | None = None,
    ) -> Callable[[int, int], float]:
        """`decide_tiles(row_tiles, tokens, ...).predicted`, T(C*), as a function of
        (tokens, row_tiles) at these other sizes, without building or keeping a plan: what
        ranking L reads for every launch (`ops.planning` keeps one per launch shape less M
        and L). The sizes but M are checked, and what reads neither M nor the routing
        computed (`search.routing_t`), here; M is checked per call."""
        if comm_ctas is not None or not enabled:  # (T at the given C: the plan's own)
            planned = self.planner(hidden, ffn, world, splits, local_experts, groups,
                                   comm_ctas, enabled, topk, local_topk)
            return lambda tokens, row_tiles: planned(tokens, row_tiles).predicted
        return routing_t(*self._less_m(hidden, ffn, world, splits, local_experts, groups,
                                       topk, local_topk), splits, self.kernel, self.device,
                         self.calib)

    def planner(
        self, hidden: int, ffn: int, world: int, splits: int, local_experts: int,
        groups: int = 1, comm_ctas: int | None = None, enabled: bool = True,
        topk: int | None = None, local_topk: float | None = None,
    ) -> Callable[[int, int], Plan]:
        """`decide_tiles(row_tiles, tokens, ...)` as a function of (tokens, row_tiles) at
        these other sizes, without its memo: for a caller that keeps its decisions itself
        (`ops.planning` keeps each launch's). Checked and computed as `predictor`."""
        return routing_plan(*self._less_m(hidden, ffn, world, splits, local_experts, groups,
                                          topk, local_topk), splits, self.kernel, self.device,
                            self.calib, comm_ctas, enabled)

    def _less_m(self, hidden: int, ffn: int, world: int, splits: int, local_experts: int,
                groups: int, topk: int | None,
                local_topk: float | None) -> tuple[int, int, int, float]:
        """(W_comp per row tile, W_comm per row of comm tiles, D, rho) at these sizes,
        checked: all that the model reads but the routing and M (`search.routing_t`)."""
        # at one row tile W_comp is per_row, and at M = 1 W_comm is one row of comm tiles
        sizes = (1, hidden, ffn, world, splits, groups, topk, local_topk)
        per_row, comm_cols, rho = self._tiles(1, sizes, local_experts)
        return per_row, comm_cols, world, rho

    def _tiles(self, row_tiles: int, sizes: tuple, local_experts: int) -> tuple[int, int, float]:
        """(W_comp, W_comm, rho) at these sizes (M, N, K, D, L, g, k, local k). Of what
        they read, only the routing and M change from one call of a layer to the next:
        the rest, and the checks of the other sizes, come from `_sized`."""
        if row_tiles < 0 or local_experts < 1:
            raise ValueError("row_tiles must be >= 0 and local_experts >= 1")
        tokens = sizes[0]
        plain = type(row_tiles) is int and type(tokens) is int and tokens >= 1
        sized = self._sized.get(sizes[1:]) if plain else None
        if sized is None:
            sized = self._size(sizes, row_tiles)
        col_tiles, comm_cols, rho = sized
        return (sizes[5] * row_tiles * col_tiles,
                comm_row_tiles(tokens, sizes[3], self.kernel) * comm_cols, rho)

    def _size(self, sizes: tuple, row_tiles: int) -> tuple[int, int, float]:
        """(ceil(ceil(N/L) / TN), ceil(ceil(N/L) / TNc), rho) at these sizes, checked as a
        Workload of one expert with row_tiles * TM rows is, and kept (less M)."""
        if not plainly_valid(sizes, (row_tiles,)):
            tokens, hidden, ffn, world, splits, groups, topk, local_topk = sizes
            Workload(tokens, hidden, ffn, world, splits, (row_tiles * self.kernel.tile_m,),
                     groups, topk, local_topk)  # (raises what is wrong)
        named = Sizes(*sizes)
        sized = (split_col_tiles(named, self.kernel), comm_col_tiles(named, self.kernel),
                 service_ratio(named, self.kernel, self.calib))
        if len(self._sized) >= self.max_entries:
            self._sized.clear()
        self._sized[sizes[1:]] = sized
        return sized

    def _store(self, key: tuple, result: Plan) -> Plan:
        self.misses += 1
        if len(self._plans) >= self.max_entries:
            self._plans.clear()  # shapes churn rarely; a full reset keeps this O(1)
        self._plans[key] = result
        return result
