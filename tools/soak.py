"""Soak: many operator calls of varying shapes, each bounded in time; memory over the run.

    python tools/soak.py --json out/soak.json                  # one GPU, 10,000 calls
    torchrun --nproc-per-node 2 tools/soak.py --json out/soak_2.json    # a group of two
    python tools/soak.py --smoke --calls 6 --report-every 2    # CPU: the interpreter
    torchrun --nproc-per-node 2 tools/soak.py --fault-every 300 --json out/soak_faults.json

Each call draws M (tokens), the routing's skew, C and L (None: the planner's) from fixed
sets, the same draw on every rank, and runs `gemm2_gather_rs` with its waits bounded
(`--wait-timeout-s`) and a watchdog on the host (`--call-timeout-s`: a call that takes
longer dumps every thread's stack and ends the process, exit code 1: a hang). Every
`--check-every` calls the output is compared with the reference's (`reference_out`:
each rank's full partial by the reference path's torch ops, summed over the group by an
all-reduce; on CPU tensors where the ranks share a GPU, whose group is gloo since NCCL
refuses two ranks on one device). Host memory
(RSS), CUDA memory (allocated, reserved) and the buffer's peer (symmetric) memory and
caches are sampled at the start, every `--report-every` calls and at the end; the
verdict compares the end with the first sample after warm-up (the first
`--report-every` calls compile the kernels and meet every shape of the sets).

Faults (`--fault-every N`, a group of ranks): every N-th call is a fault, a skipped call
(the last rank does not make it; its peers' waits run out; a gloo/NCCL barrier then
lets the skipping rank go on, so that its next call comes after its peers gave up, the
only skip the op can tell from a late call) or a mismatched size (rank 0 calls with
another M), alternately. Every rank must raise for the fault call or the call after it
(its next; `kernels/flags.py`), and every call that returns in that window and the one
after it is compared with that input's reference output, computed once at the start:
the report counts faults injected, faults detected on every rank, and wrong results
(which must be 0). Expected errors are not failures.

Exit code: 0, 1 (a call raised, a check failed, a fault went undetected or gave a wrong
result, or the watchdog ended a hung call), 2
(memory grew past the tolerances). The inputs are built once (a pool), so the memory the run
holds for them is constant.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import env_info, write_json  # noqa: E402

from megatron_overlap.ops import OverlapConfig, default_session, gemm2_gather_rs  # noqa: E402
from megatron_overlap.routing import route  # noqa: E402

REFERENCE = OverlapConfig(backend="reference")  # (the check's own path)

MIB = 1 << 20
#: growth past these (end minus the warm sample) is reported as growth
TOLERANCE = dict(rss=(32 * MIB, 0.02), cuda_allocated=(1 * MIB, 0.0),
                 cuda_reserved=(16 * MIB, 0.0), peer_memory=(0, 0.0))
#: (hidden N, FFN K, experts E, top-k) of the shapes; M from --tokens
SHAPES = {"tiny": (64, 32, 8, 2), "granite": (1024, 512, 32, 8), "qwen": (2048, 1408, 60, 4)}
ROUTINGS = ("uniform", "p50", "p90")
_OWNED: list = []  # the process group this run initialized (and destroys)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--report-every", type=int, default=1_000)
    ap.add_argument("--check-every", type=int, default=100,
                    help="compare a call with the reference backend every this many calls")
    ap.add_argument("--model", default=None, choices=sorted(SHAPES),
                    help="shape family (default: qwen on CUDA, tiny with --smoke)")
    ap.add_argument("--tokens", default=None,
                    help="comma list of M to draw from (default: 512,2048,4096,8192; smoke 16,32,48)")
    ap.add_argument("--comm-ctas", default="0,1,2,4,8,16",
                    help="C to draw from (0: the planner's)")
    ap.add_argument("--splits", default="0,1,2,4", help="L to draw from (0: the planner's)")
    ap.add_argument("--seeds", type=int, default=2, help="routings drawn per (M, skew)")
    ap.add_argument("--wait-timeout-s", type=float, default=10.0,
                    help="OverlapConfig.wait_timeout_s of every call")
    ap.add_argument("--call-timeout-s", type=float, default=None,
                    help="host watchdog per call (default: 2 x wait timeout + 60 s)")
    ap.add_argument("--fault-every", type=int, default=0,
                    help="inject a fault every this many calls (0: none; a group of ranks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU: gloo, the interpreter, tiny shapes")
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    args.model = args.model or ("tiny" if smoke else "qwen")
    args.tokens = [int(t) for t in (args.tokens or ("16,32,48" if smoke else
                                                    "512,2048,4096,8192")).split(",")]
    args.comm_ctas = [int(c) or None for c in args.comm_ctas.split(",")]
    args.splits = [int(s) or None for s in args.splits.split(",")]
    args.call_timeout_s = args.call_timeout_s or 2 * args.wait_timeout_s + 60
    for name in ("calls", "report_every", "check_every", "seeds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fault_every and (args.fault_every < 3 or len(set(args.tokens)) < 2):
        ap.error("--fault-every needs >= 3 (a fault's window is two calls) and two --tokens")
    return args


def setup():
    """(group or None, world, rank, device, backend): torchrun's group where launched so."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cuda = torch.cuda.is_available()
        if not dist.is_initialized():  # (a test's ranks come with their group)
            # (ranks that share a GPU: gloo, as NCCL refuses two ranks on one device)
            shared = cuda and int(os.environ["WORLD_SIZE"]) > torch.cuda.device_count()
            dist.init_process_group("nccl" if cuda and not shared else "gloo")
            _OWNED.append(dist.group.WORLD)
        if cuda:
            # (ranks may share one GPU: peer memory through CUDA IPC then, slower)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank()))
                                  % torch.cuda.device_count())
        group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    else:
        group, world, rank = None, 1, 0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    return group, world, rank, device, "triton" if device.type == "cuda" else "interpret"


def build_pool(args, world: int, rank: int, device) -> list[dict]:
    """Every (M, skew, seed) input of this rank, once: TP over the group (each rank holds
    every expert and a K / world shard), routing from `megatron_overlap.routing`."""
    hidden, ffn, experts, topk = SHAPES[args.model]
    k = max(8, ffn // world // 8 * 8)  # (16-byte rows for the descriptors)
    pool = []
    for tokens in args.tokens:
        tokens = -(-tokens // world) * world
        for skew in ROUTINGS:
            for seed in range(args.seeds):
                topk_idx = route(tokens, experts, topk, skew, seed)  # [M, k]
                flat_e = topk_idx.reshape(-1)
                flat_t = torch.arange(tokens)[:, None].expand_as(topk_idx).reshape(-1)
                order = torch.argsort(flat_e * tokens + flat_t)
                g = torch.Generator(device=device).manual_seed(seed * 7919 + rank + 1)
                x = torch.randn(flat_t.numel(), k, generator=g, device=device)
                w = torch.randn(experts, hidden, k, generator=g, device=device) / k ** 0.5
                pool.append(dict(x=x.to(torch.bfloat16), weight=w.to(torch.bfloat16),
                                 counts=torch.bincount(flat_e, minlength=experts).tolist(),
                                 token_index=flat_t[order].to(device), tokens=tokens,
                                 topk=topk, skew=skew))
    return pool


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (peak, where no /proc)


def sample(calls: int, device, group=None) -> dict:
    """Memory now: host RSS, CUDA allocated / reserved, the buffers' peer memory and
    cache entries (plan decisions, plan caches)."""
    session = default_session(group, device)
    bufs = session.buffers()
    out = dict(calls=calls, time_s=time.monotonic(), rss=_rss(),
               cuda_allocated=torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
               cuda_reserved=torch.cuda.memory_reserved(device) if device.type == "cuda" else 0,
               peer_memory=sum(b.peer_bytes for b in bufs),
               **session.planner.cached_counts())
    return out


def growth(samples: list[dict]) -> dict:
    """End minus the warm sample (the second, after the first --report-every calls) per
    field, and whether it is past the tolerance; None where the run is too short."""
    if len(samples) < 3:
        return dict(judged=False, why="fewer than two samples after warm-up", fields={})
    warm, end = samples[1], samples[-1]
    fields = {}
    for name, (floor, share) in TOLERANCE.items():
        grew = end[name] - warm[name]
        fields[name] = dict(warm=warm[name], end=end[name], growth=grew,
                            grew=grew > max(floor, share * warm[name]))
    return dict(judged=True, fields=fields)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


FAULT_KINDS = ("skip", "size")


class Faults:
    """The faults injected on this rank (`--fault-every`): which calls are faults, which
    input rank 0 calls in a size fault, what each call of a fault's window did, and
    every output returned there checked against its input's reference output."""

    def __init__(self, every: int, pool: list, group, world: int, rank: int):
        self.every = every if group is not None else 0
        self.group, self.world, self.rank = group, world, rank
        self.wants = [reference_out(inp, group, world, rank) for inp in pool] \
            if self.every else []
        self.log: list[dict] = []  # per fault: kind, whether this rank raised (call, next)
        self.checked = self.wrong = 0

    def kind(self, call: int) -> str | None:
        if not self.every or call % self.every:
            return None
        return FAULT_KINDS[(call // self.every) % 2]

    def window(self, call: int) -> int | None:
        """0: a fault call, 1: the next (errors expected in both), 2: the call after."""
        back = call % self.every if self.every and call >= self.every else None
        return back if back is not None and back <= 2 else None

    def input_of(self, call: int, index: int, pool: list) -> int:
        """The input this rank calls: rank 0's in a size fault has another M."""
        if self.kind(call) != "size" or self.rank != 0:
            return index
        return next(i for i, inp in enumerate(pool) if inp["tokens"] != pool[index]["tokens"])

    def skips(self, call: int) -> bool:
        return self.kind(call) == "skip" and self.rank == self.world - 1

    def note(self, call: int, index: int, out, err) -> bool:
        """Record a call of a fault's window; whether its error (if any) was expected."""
        at = self.window(call)
        if at is None:
            return False
        if at == 0:
            self.log.append(dict(call=call, kind=self.kind(call), raised=[False, False]))
        if at < 2:
            self.log[-1]["raised"][at] = err is not None
        if out is not None:
            self.checked += 1
            self.wrong += not rel_err(out, self.wants[index]) < 2e-2  # (NaN is wrong)
        return at < 2

    def report(self) -> dict:
        """Faults injected, detected on every rank (each raised for the fault call or its
        next), and the wrong results of every rank (collective)."""
        if not self.every:
            return dict(every=0)
        logs, wrong = [None] * self.world, [None] * self.world
        dist.all_gather_object(logs, self.log, group=self.group)
        dist.all_gather_object(wrong, (self.checked, self.wrong), group=self.group)
        seen = [all(any(log[i]["raised"]) for log in logs) for i in range(len(self.log))]
        return dict(every=self.every, injected=len(self.log), detected_every_rank=sum(seen),
                    undetected=[f["call"] for f, ok in zip(self.log, seen) if not ok][:10],
                    checked=sum(c for c, _ in wrong), wrong_results=sum(w for _, w in wrong))


def reference_out(inp: dict, group, world: int, rank: int) -> torch.Tensor:
    """This rank's [M / D, N] of the input by the reference path (the op's `reference`
    backend on this rank alone): its own partial, summed over the group (a CPU all-reduce
    where the group is gloo)."""
    full = gemm2_gather_rs(inp["x"], inp["weight"], inp["counts"], inp["token_index"],
                           inp["tokens"], inp["topk"], config=REFERENCE).float()
    if world > 1:
        on_cpu = dist.get_backend(group) == "gloo"
        full = full.cpu() if on_cpu else full
        dist.all_reduce(full, group=group)
    return full.chunk(world)[rank].to(inp["x"].device, inp["x"].dtype)


def _op_args(inp: dict, group) -> tuple:
    return (inp["x"], inp["weight"], inp["counts"], inp["token_index"], inp["tokens"],
            inp["topk"], None, group)


def _attempt(op_args, config, kwargs, group, device, backend):
    """(output, None) or (None, the error) of one bounded call."""
    try:
        out = gemm2_gather_rs(*op_args, config=config, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        default_session(group, device).check()
        return out, None
    except Exception as err:  # noqa: BLE001 - a soak counts failures, it does not stop
        return None, err


def run(args) -> dict:
    group, world, rank, device, backend = setup()
    config = OverlapConfig.from_env(backend=backend, wait_timeout_s=args.wait_timeout_s)
    pool = build_pool(args, world, rank, device)
    faults = Faults(args.fault_every, pool, group, world, rank)
    rng = random.Random(args.seed)  # (the same draws on every rank)
    hidden = SHAPES[args.model][0]
    samples = [sample(0, device, group)]
    times, failures, checks = [], [], []
    if rank == 0:
        print(f"soak: {args.calls} calls, {args.model} (N={hidden}), M in {args.tokens}, "
              f"{len(pool)} inputs, world {world}, backend {backend}, fault every "
              f"{faults.every or '-'}", flush=True)
    for call in range(1, args.calls + 1):
        index = faults.input_of(call, rng.randrange(len(pool)), pool)
        inp = pool[index]
        c, l = rng.choice(args.comm_ctas), rng.choice(args.splits)
        kwargs = dict(comm_ctas=c, splits=l if l is None or l <= hidden else None)
        faulthandler.dump_traceback_later(args.call_timeout_s, exit=True)  # (a hang)
        start = time.monotonic()
        out, err = (None, None) if faults.skips(call) else _attempt(
            _op_args(inp, group), config, kwargs, group, device, backend)
        times.append(time.monotonic() - start)
        if faults.kind(call) == "skip":  # (the skipping rank's next call after the bound)
            dist.barrier(group=group)
        faulthandler.cancel_dump_traceback_later()
        if not faults.note(call, index, out, err) and err is not None:
            failures.append(dict(call=call, M=inp["tokens"], C=c, L=l,
                                 error=f"{type(err).__name__}: {err}"[:400]))
        if out is not None and call % args.check_every == 0 and faults.window(call) is None:
            want = reference_out(inp, group, world, rank)
            checks.append(dict(call=call, rel_err=rel_err(out, want)))
        if call % args.report_every == 0 or call == args.calls:
            samples.append(sample(call, device, group))
            _progress(rank, samples[-1], failures, times)
    return _result(args, world, backend, hidden, times, failures, checks, samples,
                   faults.report(), group)


def _progress(rank: int, s: dict, failures: list, times: list) -> None:
    if rank == 0:
        print(f"  call {s['calls']}: rss {s['rss'] / MIB:.1f} MiB, cuda allocated "
              f"{s['cuda_allocated'] / MIB:.1f} / reserved {s['cuda_reserved'] / MIB:.1f}"
              f" MiB, peer memory {s['peer_memory'] / MIB:.2f} MiB, decisions "
              f"{s['decisions']}, failures {len(failures)}, max call "
              f"{max(times):.3f} s", flush=True)


def _result(args, world, backend, hidden, times, failures, checks, samples, faults,
            group) -> dict:
    grew = growth(samples)
    worst = max((c["rel_err"] for c in checks), default=None)
    result = dict(
        tool="soak", env=env_info(), world=world, backend=backend, model=args.model,
        hidden=hidden, tokens=args.tokens, comm_ctas=args.comm_ctas, splits=args.splits,
        calls=args.calls, wait_timeout_s=args.wait_timeout_s,
        call_timeout_s=args.call_timeout_s, hang=False,
        call_s=dict(median=statistics.median(times), max=max(times)),
        failures=len(failures), first_failures=failures[:10],
        checks=dict(count=len(checks), max_rel_err=worst,
                    passed=worst is None or worst < 2e-2),
        faults=faults, samples=samples, growth=grew,
        verdict=verdict(failures, worst, grew, faults))
    if group is not None:
        dist.barrier()
    return result


def verdict(failures: list, worst: float | None, grew: dict, faults: dict | None = None) -> str:
    faults = faults or {}
    if failures or (worst is not None and worst >= 2e-2) or faults.get("wrong_results") or \
            faults.get("injected", 0) != faults.get("detected_every_rank", 0):
        return "failures"
    if grew["judged"] and any(f["grew"] for f in grew["fields"].values()):
        return "memory growth: " + ", ".join(n for n, f in grew["fields"].items() if f["grew"])
    return "ok: no hang, no failure, no growth" if grew["judged"] else \
        "ok: no hang, no failure (too short to judge growth)"


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json(args.json, result)
        print(f"soak: {result['verdict']}; median call {result['call_s']['median']:.4f} s, "
              f"max {result['call_s']['max']:.3f} s (bound {args.call_timeout_s:g} s)")
    if _OWNED:
        dist.destroy_process_group(_OWNED.pop())
    if result["verdict"] == "failures":
        return 1
    return 2 if result["verdict"].startswith("memory growth") else 0


if __name__ == "__main__":
    sys.exit(main())
