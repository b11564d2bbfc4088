"""Shared benchmark method (the paper's): warm-up, ABBA-interleaved samples, the median of
the maximum-rank latency, 95% bootstrap confidence intervals, environment capture."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

if "--smoke" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_overlap.stats import bootstrap_ci  # noqa: E402


def add_run_args(ap) -> None:
    """The flags every GPU tool shares: output, tile choice, CPU smoke check."""
    ap.add_argument("--json", default="", help="write the results here (rank 0)")
    ap.add_argument("--tiles", default=None, help="tune_tiles.py JSON whose `best` to use")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of this script: gloo, the interpreter, the tiny shape")


def smoke_setup(args) -> tuple[str, str]:
    """Process group and (op backend, device) for a GPU run, or a `--smoke` CPU check."""
    if getattr(args, "smoke", False):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo")
        args.model = "tiny"
        for name, value in (("seqs", "16"), ("seq", 16), ("cmax", 4), ("c_sweep", 4),
                            ("samples", 3), ("warmup", 1), ("c_cal", 3),
                            ("overlap_cset", "2,3")):
            if hasattr(args, name):
                setattr(args, name, value)
        return "interpret", "cpu"
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return "triton", "cuda"


def env_info() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import megatron.core

        info["megatron_core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpus=torch.cuda.device_count(), sms=p.multi_processor_count,
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=10).stdout.strip().splitlines()
            info["driver_and_max_sm_clock"] = out[0] if out else ""
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                  timeout=10).stdout
            info["topology"] = topo.strip().splitlines()[:4]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def _sync(group=None):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier(group=group)


def time_once(fn, group=None) -> float:
    """One sample in ms on this rank, ranks aligned by a barrier before it."""
    _sync(group)
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def abba(policies: dict, samples: int, warmup: int, group=None, progress: str = "") -> dict:
    """{name: [ms per sample, max over ranks]}.

    Rounds come in pairs: a random order of the policies (seeded by the pair, the same on
    every rank), then that order reversed, so slow drift cancels (ABBA) and no policy
    always runs next to the same neighbour. With a fixed order, a policy placed right
    after the reference path measured up to 19% slower than the same policy placed among
    the C sweep (two H200s).
    """
    names = list(policies)
    for name in names:
        for _ in range(warmup):
            policies[name]()
    _sync(group)
    per = {n: [] for n in names}
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    rounds = range(samples)
    if rank0 and progress:
        try:
            from tqdm import tqdm

            rounds = tqdm(rounds, desc=progress, leave=False, file=sys.stderr)
        except ImportError:
            pass
    for r in rounds:
        order = names[:]
        random.Random(r // 2).shuffle(order)
        for n in (order if r % 2 == 0 else reversed(order)):
            per[n].append(time_once(policies[n], group))
    if dist.is_initialized():  # the max-rank latency of every sample
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.tensor([per[n] for n in names], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        per = {n: t[i].tolist() for i, n in enumerate(names)}
    return per


def median_ci(values) -> tuple[float, float, float]:
    """Median and its 95% bootstrap CI (scipy.stats.bootstrap, percentile)."""
    lo, hi = bootstrap_ci(values)
    return statistics.median(values), lo, hi


def summarize(per: dict) -> dict:
    return {n: dict(zip(("median", "ci_low", "ci_high"), median_ci(v)), samples=v)
            for n, v in per.items()}


def write_json(path: str, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def without_samples(stats: dict) -> dict:
    """`summarize` output for a JSON file: every statistic but the raw samples."""
    return {n: {k: v for k, v in s.items() if k != "samples"} for n, s in stats.items()}
