"""Decision cache: repeated layers and steps pay one dictionary look-up (stdlib only)."""

from __future__ import annotations

from .calibration import Calibration
from .inputs import DeviceSpec, KernelSpec, Workload
from .quantities import expert_row_tiles
from .search import Plan, plan


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
            found = self._store(key, workload)
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
            if row_tiles < 0 or local_experts < 1:
                raise ValueError("row_tiles must be >= 0 and local_experts >= 1")
            workload = Workload(tokens, hidden, ffn, world, splits,
                                (row_tiles * self.kernel.tile_m,), groups, topk, local_topk)
            found = self._store(key, workload)
        else:
            self.hits += 1
        return found

    def _store(self, key: tuple, workload: Workload) -> Plan:
        comm_ctas, enabled = key[-2], key[-1]
        self.misses += 1
        result = plan(workload, self.kernel, self.device, self.calib,
                      comm_ctas=comm_ctas, enabled=enabled)
        if len(self._plans) >= self.max_entries:
            self._plans.clear()  # shapes churn rarely; a full reset keeps this O(1)
        self._plans[key] = result
        return result
