"""When each host step of one op call starts and ends, without a profiler's inflation.

    torchrun --nproc-per-node 1 tools/host_steps.py --model qwen --seq 4096 --json out/steps.json
    python tools/host_steps.py --smoke                                    # CPU, interpreter

The operator's host work between Megatron's sync and the GEMM2 launch is time the GPU
waits (docs/RESULTS.md, "What limits us now"). `host_timeline.py` shows it with
torch.profiler, which roughly doubles every step (each Python call and CUDA API call is
recorded); `host_overhead.py` times steps in back-to-back loops, where the caches are
warm and no step follows a sync. Here each call runs as the benchmarks time it (right
after a synchronize), and the op's own functions are wrapped by a timer that costs well
under a microsecond: for every step, its start and end in us after the op was entered,
median over the calls. The row to read is the GEMM2 launch: everything before it is
exposed latency. The arms (`ARMS`: the default; its event records, waits and error copy
through torch instead of the driver; the expert offsets summed on the host and copied
instead of read in place) run interleaved, so their rows compare side by side.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import env_info, smoke_setup, write_json  # noqa: E402
from host_timeline import summarize_calls  # noqa: E402
from workloads import OpCase, op_kwargs, rank_inputs  # noqa: E402

from megatron_overlap.kernels import gather_rs, gemm2, launch_cache  # noqa: E402
from megatron_overlap.ops import (OverlapConfig, buffer, counts_ring,  # noqa: E402
                                  gemm2_gather_rs, groups, launcher, op, routing)

_record: list | None = None


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _record is None:
            return fn(*args, **kwargs)
        label = name(args) if callable(name) else name
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _record.append((label, t0, time.perf_counter_ns()))
    return wrapper


def _kernel_name(args) -> str:
    k = args[0].kernel
    return f"LaunchCache.launch {getattr(k, '__name__', None) or k.fn.__name__}"


#: (owner, attribute, label): the op's steps, where the op looks them up
STEPS = [
    (op, "_checked_call", "_checked_call (validate, counts, backend)"),
    (op, "validate", "validate"), (op, "host_counts", "host_counts"),
    (groups, "resolve_backend", "resolve_backend"), (groups, "_peer_capable", "_peer_capable"),
    (buffer.OverlapBuffer, "check", "OverlapBuffer.check"),
    (op, "launch_tiles", "launch_tiles"),
    (buffer.OverlapBuffer, "ensure", "OverlapBuffer.ensure"),
    (routing.Router, "route", "Router.route (offsets, routing table)"),
    (counts_ring.CountsRing, "write", "CountsRing.write"),
    (counts_ring.CountsRing, "record", "CountsRing.record"),
    (gemm2, "packed_offsets_host", "packed_offsets_host (copy path)"),
    (gemm2, "unpack_offsets", "unpack_offsets"),
    (routing, "route_rows", "route_rows (the routing-table kernels)"),
    (launcher._Comm, "__call__", "GatherRS's launch (and the tail helpers')"),
    (op, "_plan_request", "_plan_request"),
    (op, "plan_launch", "plan_launch (the cached plan)"),
    (op, "log_decision", "log_decision"), (op, "_forward", "_forward"),
    (launcher, "launch", "launcher.launch"),
    (gemm2, "grouped_gemm2_launcher", "grouped_gemm2_launcher (GEMM2 args, binary)"),
    (gather_rs, "launch_gather_rs", "launch_gather_rs"),
    (launch_cache.LaunchCache, "compiled", "LaunchCache.compiled (key, lookup)"),
    (launch_cache.LaunchCache, "launch", _kernel_name),
    (buffer.OverlapBuffer, "note_launch", "note_launch"),
]


def instrument(set_attr=setattr) -> None:
    """Wrap every step in place (`set_attr`: e.g. pytest's monkeypatch.setattr)."""
    for owner, attr, label in STEPS:
        set_attr(owner, attr, _timed(label, getattr(owner, attr)))


def calls_of(fn, calls: int, sync) -> list[list]:
    """Per call: every recorded step as (kind, label, start, end), us after entering `fn`."""
    global _record
    per_call = []
    for _ in range(calls):
        sync()
        _record = []
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        rec, _record = _record, None
        per_call.append([("host", "op call", 0.0, (t1 - t0) / 1e3)]
                        + [("host", label, (a - t0) / 1e3, (b - t0) / 1e3)
                           for label, a, b in rec])
    return per_call


def table_of(per_call: list[list]) -> list[dict]:
    """Median start / end of every recorded step, by occurrence."""
    return [dict(step=r["name"], n=r["n"], calls=r["calls"], start_us=r["start_us"],
                 end_us=r["end_us"]) for r in summarize_calls(per_call)]


def steps_of(fn, calls: int, sync) -> list[dict]:
    """Median start / end (us after entering `fn`) of every recorded step, by occurrence."""
    return table_of(calls_of(fn, calls, sync))


#: (mapped_offsets, driver stream ops) per arm: the default reads the host's counts in
#: place from a pinned ring (the routing-table kernel sums them) and records events, waits
#: and copies the error word through the driver (`ops/stream_ops.py`); the others change
#: one of the two (`Router.mapped_offsets`, `StreamOps.raw`)
ARMS = {"default": (True, True), "torch events": (True, False),
        "copied offsets": (False, True)}


def set_arm(buf, arm: str, driver_ok: bool) -> None:
    """`driver_ok`: the buffer's own StreamOps.raw (no driver arm where it is False)."""
    router = routing.Router.get(buf.device)
    router.mapped_offsets, raw = ARMS[arm]
    if buf.stream_ops is not None:  # (the error word's, the ring's, the launcher's)
        for ops in (buf.stream_ops, router.counts_ring.stream_ops,
                    launcher._Streams.of(buf).ops):
            ops.raw = raw and driver_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--layout", default="TP2EP1")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpreter, tiny shape")
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    if args.smoke:
        args.calls = 3
    inp = rank_inputs(OpCase(args.model, args.layout, args.seq, "uniform"), dist.get_rank(),
                      device)
    run = op_kwargs(inp, dist.group.WORLD)
    cfg = OverlapConfig.from_env(backend=backend)
    for _ in range(3):  # compiled, planned, allocated
        gemm2_gather_rs(**run, config=cfg)
    instrument()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    buf = op.prepare(**run, config=cfg).buffer  # the op's own (keyed by its device)
    per_arm = {arm: [] for arm in ARMS}
    driver_ok = buf.stream_ops is not None and buf.stream_ops.raw
    rounds = max(1, args.calls // 5)
    for _ in range(rounds):  # the arms interleaved, five calls at a time
        for arm in ARMS:
            set_arm(buf, arm, driver_ok)
            per_arm[arm] += calls_of(lambda: gemm2_gather_rs(**run, config=cfg), 5, sync)
    set_arm(buf, "default", driver_ok)
    tables = {arm: table_of(calls) for arm, calls in per_arm.items()}
    if dist.get_rank() == 0:
        for arm, table in tables.items():
            print(f"host steps of one op call, {arm} ({args.model} {args.layout} "
                  f"S={args.seq}, median of {5 * rounds} calls, each after a sync), us after "
                  f"entering the op:")
            for r in table:
                print(f"  step {r['step']:<48} {r['n']} {r['start_us']:8.1f} -> "
                      f"{r['end_us']:8.1f}")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv),
                                   steps=tables["default"], arms=tables))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
