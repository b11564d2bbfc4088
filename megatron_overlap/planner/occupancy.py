"""Resident CTAs per SM from a compiled kernel's resource use (stdlib only).

o_comp and o_comm of the model come from here, fed with the registers, threads and
shared memory the compiler reports for the real binary, never from constants.
The rules follow the CUDA occupancy calculator: registers are allocated per warp in
units of 256 and each of the SM's four sub-partitions holds a quarter of the register
file; shared memory is allocated in 128-byte units plus 1 KB the runtime reserves per CTA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SMLimits:
    """Per-SM residency limits of one GPU architecture."""

    name: str
    registers: int = 65536
    max_registers_per_thread: int = 255
    register_unit: int = 256  # registers allocated per warp in these units
    sub_partitions: int = 4
    threads: int = 2048
    warps: int = 64
    ctas: int = 32
    shared_bytes: int = 228 * 1024
    shared_unit: int = 128
    shared_reserved_per_cta: int = 1024


HOPPER = SMLimits("sm90")
AMPERE_A100 = SMLimits("sm80", shared_bytes=164 * 1024)


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    limited_by: str  # "registers", "shared memory", "threads", "warps" or "ctas"


def resident_ctas(
    registers_per_thread: int,
    threads_per_cta: int,
    shared_bytes_per_cta: int,
    limits: SMLimits = HOPPER,
) -> Occupancy:
    """How many CTAs of one kernel an SM holds at once, and what limits it.

    >>> resident_ctas(240, 128, 96 * 1024).ctas_per_sm   # a 128x128x64 Triton tile
    2
    """
    if not 0 < registers_per_thread <= limits.max_registers_per_thread:
        raise ValueError(
            f"registers_per_thread must be in 1..{limits.max_registers_per_thread}, "
            f"got {registers_per_thread}"
        )
    if not 0 < threads_per_cta <= 1024:
        raise ValueError(f"threads_per_cta must be in 1..1024, got {threads_per_cta}")
    if shared_bytes_per_cta < 0:
        raise ValueError(f"shared_bytes_per_cta must be >= 0, got {shared_bytes_per_cta}")

    warps = -(-threads_per_cta // 32)
    regs_per_warp = -(-registers_per_thread * 32 // limits.register_unit) * limits.register_unit
    per_partition = limits.registers // limits.sub_partitions
    warps_by_regs = (per_partition // regs_per_warp) * limits.sub_partitions
    smem = -(-shared_bytes_per_cta // limits.shared_unit) * limits.shared_unit
    smem += limits.shared_reserved_per_cta
    bounds = {
        "registers": warps_by_regs // warps,
        "shared memory": limits.shared_bytes // smem,
        "threads": limits.threads // (warps * 32),
        "warps": limits.warps // warps,
        "ctas": limits.ctas,
    }
    limited_by = min(bounds, key=bounds.get)
    if bounds[limited_by] < 1:
        raise ValueError(
            f"a CTA of {threads_per_cta} threads x {registers_per_thread} registers with "
            f"{shared_bytes_per_cta} B shared memory does not fit one {limits.name} SM "
            f"({limited_by})"
        )
    return Occupancy(bounds[limited_by], limited_by)


def co_resident(parts, limits: SMLimits = HOPPER) -> str | None:
    """None if one SM holds all of `parts` at once, else the resource that does not fit.

    `parts`: (registers_per_thread, threads_per_cta, shared_bytes_per_cta, ctas) per
    kernel, e.g. two GEMM2 CTAs and one GatherRS CTA (the shared placement). A CTA's
    warps are spread over the four sub-partitions, each of which holds a quarter of the
    register file; the SM's shared memory is configured once for all of them (the op
    asks for the largest carveout)."""
    regs = smem = threads = warps = ctas = 0
    unit = limits.register_unit
    for registers_per_thread, threads_per_cta, shared_bytes, count in parts:
        if not (0 < registers_per_thread <= limits.max_registers_per_thread
                and 0 < threads_per_cta <= 1024 and shared_bytes >= 0 and count >= 0):
            raise ValueError(f"co_resident: each part is (registers per thread in 1.."
                             f"{limits.max_registers_per_thread}, threads per CTA in "
                             f"1..1024, shared bytes >= 0, CTAs >= 0), got "
                             f"{(registers_per_thread, threads_per_cta, shared_bytes, count)}")
        w = -(-threads_per_cta // 32)
        regs_per_warp = -(-registers_per_thread * 32 // unit) * unit
        regs += count * -(-w // limits.sub_partitions) * regs_per_warp  # per sub-partition
        smem += count * (-(-shared_bytes // limits.shared_unit) * limits.shared_unit
                         + limits.shared_reserved_per_cta)
        threads += count * w * 32
        warps += count * w
        ctas += count
    for name, used, cap in (("registers", regs, limits.registers // limits.sub_partitions),
                            ("shared memory", smem, limits.shared_bytes),
                            ("threads", threads, limits.threads), ("warps", warps, limits.warps),
                            ("ctas", ctas, limits.ctas)):
        if used > cap:
            return name
    return None
