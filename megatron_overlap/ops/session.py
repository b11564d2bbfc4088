"""`OverlapSession`: the op's state on one reduce-scatter group and device, with a lifecycle.

    session = OverlapSession(group, device, config)    # once (queries the group, collective)
    out = session(x, weight, counts, token_index, M, k)  # the op; or, in two steps:
    handle = session.prepare(x, weight, counts, token_index, M, k)  # route and plan
    out = session.launch(handle, x, weight)          # the kernels
    session.check(); session.reset(); session.close()

Kernels compile at the session's warm-up, never while planning:
    session.warm_up(hidden, topk, dtype)  # compile the kernel families those calls run

The session owns everything a call leaves behind for the next: one `OverlapBuffer` per
backend (peer memory, flags, epoch, error word, launch streams and events), the router
with its pinned counts ring, the compiled kernel families (`plans.KernelFamilies`) and
the planner that reads them, with its plan caches (`plans.Planner`, which never
compiles). A call whose families `warm_up` did not compile compiles them before it
plans, as a logged step (`plan`); a call being captured into a CUDA graph refuses to.
The op's stages (op.py) are functions of a session and keep nothing; the session keeps
nothing of a call but what the buffer's protocol needs.

`gemm2_gather_rs(...)` is the op on the default session of its group and x's device
(`default_session`), the one table of sessions in the package; OverlapMoELayer shares
that session with every layer of the group.
"""

from __future__ import annotations

import warnings

import torch

from . import launcher
from .buffer import OverlapBuffer
from .config import OverlapConfig, resolve_backend
from .fp8 import OPERAND_DTYPE, Fp8Scales, check_kind, check_sink
from .groups import check_device, group_size_rank, hosts_agree
from .op import Launch, launched, needs_grads, prepare, run
from .planning import SPLIT_CANDIDATES, KernelFamily, LaunchPlan, PlanRequest, launch_tiles
from .plans import KernelFamilies, MissingKernelFamily, Planner, family_keys, request_families
from .reference import reference_forward
from .routing import Router
from .validation import MAX_TOPK, check_int

#: (id(group), device) -> (group, session): `gemm2_gather_rs`'s sessions (the entry holds
#: the group, so its id stays its own while the session lives)
_default_sessions: dict[tuple, tuple] = {}


class OverlapSession:
    """The op's state on `group` (None: one rank) and `device` (None: the current CUDA
    device, else the CPU), with `config` the default of its calls (a call may pass its
    own: the backend, planner and tiles are per call; the state is the session's).

    Building one asks the group its size and whether every rank shares this host (a
    collective on a group of several ranks: every rank builds it together). Peer memory
    is allocated at the first call of each backend, which every rank makes together."""

    def __init__(self, group=None, device=None, config: OverlapConfig | None = None):
        if config is not None and not isinstance(config, OverlapConfig):
            raise TypeError(f"config must be an OverlapConfig, got {type(config).__name__}")
        self.group = group
        self.device = check_device(device)
        self.config = config or OverlapConfig()
        self.world, self.rank = group_size_rank(group)
        self.peer_capable = hosts_agree(group, self.world)
        if not self.peer_capable:
            warnings.warn("megatron-overlap: the group spans several hosts; peer memory "
                          "cannot reach every rank, using the reference path")
        self.router = Router(self.device)
        self.families = KernelFamilies()
        self.planner = Planner(self.families)
        self._buffers: dict[str, OverlapBuffer] = {}
        self.closed = False

    # ---------------------------------------------------------------- state
    def buffer(self, backend: str) -> OverlapBuffer:
        """The buffer of `backend` ("triton" or "interpret"), made at its first call."""
        buf = self._buffers.get(backend)
        if buf is None:
            buf = self._buffers[backend] = OverlapBuffer(self.group, self.device, backend)
        return buf

    @property
    def backends(self):
        """The backends whose buffer this session has set up (a view)."""
        return self._buffers.keys()

    def buffers(self) -> list[OverlapBuffer]:
        return list(self._buffers.values())

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this OverlapSession is closed (make a new one)")

    def _own(self, handle: Launch) -> Launch:
        """`handle`, checked to be a prepared call of this open session."""
        self.check_open()
        if not isinstance(handle, Launch):
            raise TypeError(f"handle must be a Launch (OverlapSession.prepare), got "
                            f"{type(handle).__name__}")
        if handle.buffer is not None and handle.buffer is not self._buffers.get(
                handle.buffer.backend):
            raise ValueError("handle was prepared by another OverlapSession")
        return handle

    # ---------------------------------------------------------------- kernels and plans
    def warm_up(self, hidden: int, topk: int, dtype: torch.dtype = torch.bfloat16, *,
                config: OverlapConfig | None = None, splits: int | tuple | None = None,
                token_major: bool | None = None,
                fp8: str | None = None) -> tuple[KernelFamily, ...]:
        """Compile the kernel families of calls with hidden size N = `hidden`, top-k
        `topk` and `dtype` activations, so that planning them compiles nothing.

        `config` (default: the session's) gives the backend, tiles and the calibration
        that says which L the planner ranks; `splits`: the L to compile for (an int or
        several; default: the config's, else every L the planner may choose);
        `token_major`: y's layout, True where every token has its k rows on this rank
        (TP: T = M k), False under EP, None both; `fp8`: calls on FP8 operands with scales
        of that kind ("tensor" / "block", `Fp8Scales.kind`; `dtype` is then e4m3): the FP8
        kernel's families, compiled apart. Returns the families (their residency
        o_comp, o_comm, misfit and the binaries' resources); none on the reference path.
        A family compiles once per session: a second warm-up of a shape is free. Local
        (no collective, no peer memory: the first call sets that up), nothing launched."""
        self.check_open()
        if config is not None and not isinstance(config, OverlapConfig):
            raise TypeError(f"config must be an OverlapConfig, got {type(config).__name__}")
        config = config or self.config
        hidden, topk = check_int("hidden", hidden, 1), check_int("topk", topk, 1, MAX_TOPK)
        dtype = OPERAND_DTYPE if check_kind(fp8) else dtype
        backend = resolve_backend(config.backend, self.device)
        if backend == "reference" or not self.peer_capable:
            return ()
        layouts = (True, False) if token_major is None else (bool(token_major),)
        keys = (key for tiles in dict.fromkeys(launch_tiles(config, backend, self.device,
                                                           dtype, t, fp8) for t in layouts)
                for key in family_keys(config, tiles, self.device, backend, hidden, topk,
                                       splits, fp8))
        return self.families.warm(dict.fromkeys(keys))

    def plan(self, request: PlanRequest) -> LaunchPlan:
        """The planner's plan of `request`, its kernel families compiled first where
        `warm_up` did not (logged; `families.at_call` keeps their keys)."""
        try:
            return self.planner.plan(request)
        except MissingKernelFamily:
            self.families.warm(request_families(request), at_call=True)
        return self.planner.plan(request)

    def split_predictions(self, request: PlanRequest,
                          candidates=SPLIT_CANDIDATES) -> dict[int, float]:
        """`Planner.split_predictions` at each L of `candidates`, their families compiled
        first where needed (tools ask the model about L the plan did not rank)."""
        self.families.warm(request_families(request, candidates), at_call=True)
        return self.planner.split_predictions(request, candidates)

    # ---------------------------------------------------------------- calls
    def __call__(self, x, weight, tokens_per_expert, token_index, num_tokens: int, topk: int,
                 probs=None, **options):
        """The op (`gemm2_gather_rs`, whose arguments these are, less `group`)."""
        return run(self, x, weight, tokens_per_expert, token_index, num_tokens, topk, probs,
                   **options)

    def prepare(self, x, weight, tokens_per_expert, token_index, num_tokens: int, topk: int,
                probs=None, **options) -> Launch:
        """The call checked, routed and planned, nothing launched: a `Launch` handle
        (its `plan`, `routing`, `launch_plan`, `buffer`) for `launch`. Options as the op's
        (`scales` too: the handle keeps them, and `launch` and `reference` use them), and
        `defer_slots` (op.prepare)."""
        return prepare(self, x, weight, tokens_per_expert, token_index, num_tokens, topk,
                       probs, **options)

    def launch(self, handle: Launch, x, weight, probs=None, grad_sink=None) -> torch.Tensor:
        """The output of a prepared call, on the same x, weight and probs its `prepare`
        was given (an autograd node where they, or a `grad_sink`, need gradients)."""
        self._own(handle)
        given = (tuple(x.shape), tuple(weight.shape), x.dtype)
        if given != handle.call.operands or x.device != self.device:
            raise ValueError(f"x and weight (shapes {given[0]}, {given[1]}, {given[2]} on "
                             f"{x.device}) must be those the handle was prepared with "
                             f"({handle.call.operands} on {self.device})")
        check_sink(x, weight, handle.call.scales, grad_sink)
        grads = needs_grads(x, weight, probs, handle.call.expected_rows is not None, grad_sink)
        return launched(self, handle, x, weight, probs, handle.call.token_index, grads,
                        grad_sink)

    # ---------------------------------------------------------------- one side alone
    # (calibration and benchmarks: a prepared handle's kernels without the op's host
    # bookkeeping; `launch_plan` replaces the handle's, e.g. another C, P or L)
    def launch_kernels(self, handle: Launch, x, weight, out, launch_plan=None) -> torch.Tensor:
        """GEMM2 and GatherRS overlapped into `out` [M / D, N]; returns y."""
        return launcher.launch(self._own(handle).buffer, x, weight, handle.routing,
                               launch_plan or handle.launch_plan, None, out,
                               scales=handle.call.scales)

    def gemm2_alone(self, handle: Launch, x, weight, y, launch_plan=None) -> torch.Tensor:
        """GEMM2 by itself into y [T, N] (the readiness flags cleared after it)."""
        return launcher.launch_gemm2_alone(self._own(handle).buffer, x, weight, handle.routing,
                                           launch_plan or handle.launch_plan, y,
                                           scales=handle.call.scales)

    def comm_alone(self, handle: Launch, y, out, launch_plan=None) -> None:
        """GatherRS by itself on a given y, every split ready, into `out`."""
        launcher.launch_comm_alone(self._own(handle).buffer, y, handle.routing,
                                   launch_plan or handle.launch_plan, None, out)

    def reference(self, handle: Launch, x, weight, probs=None,
                  counts_on_device: bool = False) -> torch.Tensor:
        """The reference path's [M / D, N] on a prepared handle's routing (torch's grouped
        GEMM2, the one-gather combine, NCCL's / gloo's reduce-scatter), its table complete
        (prepared with `defer_slots=False`, the default); `counts_on_device`: the grouped
        GEMM reads the counts on the device only (what a CUDA graph can capture). A handle
        of FP8 operands: their float64 product, dequantized with its scales (`fp8.py`)."""
        self._own(handle)
        return reference_forward(x, weight, handle.counts_dev,
                                 None if counts_on_device else handle.counts, handle.table,
                                 probs, self.group, self.world, handle.call.scales)[0]

    # ---------------------------------------------------------------- lifecycle
    def check(self) -> None:
        """Raise what an earlier call's kernels recorded (waits for the latest call)."""
        for buf in self._buffers.values():
            buf.check()

    def note_replays(self) -> None:
        """After replaying a CUDA graph that holds this session's calls: raise an earlier
        replay's error that reached the host, queue this replay's for the next check."""
        for buf in self._buffers.values():
            buf.note_replay()

    def reset(self) -> None:
        """Forget a failed state (collective on a group: every rank resets together)."""
        for buf in self._buffers.values():
            buf.reset()

    def close(self) -> None:
        """Release the peer memory, flags, streams and caches; later calls raise."""
        self._buffers.clear()
        self.families = KernelFamilies()
        self.planner = Planner(self.families)
        self.closed = True
        key = _key(self.group, self.device)
        if _default_sessions.get(key, (None, None))[1] is self:
            del _default_sessions[key]

    def __enter__(self) -> "OverlapSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(group, device: torch.device) -> tuple:
    return id(group), str(device)


def default_session(group=None, device=None) -> OverlapSession:
    """The session `gemm2_gather_rs` runs on for `group` and `device` (made at its first
    use: every rank of the group makes it together)."""
    device = check_device(device)
    found = _default_sessions.get(_key(group, device))
    if found is None or found[0] is not group:
        found = _default_sessions[_key(group, device)] = (group, OverlapSession(group, device))
    return found[1]


def note_replays(device=None) -> None:
    """`note_replays` of every default session (of `device`, None: all): after replaying a
    CUDA graph holding `gemm2_gather_rs` calls (`CapturedCall` does it)."""
    for _, session in list(_default_sessions.values()):
        if device is None or session.device == check_device(device):
            session.note_replays()


def gemm2_gather_rs(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert,
                    token_index: torch.Tensor, num_tokens: int, topk: int,
                    probs: torch.Tensor | None = None, group=None, *,
                    comm_ctas: int | None = None, splits: int | None = None,
                    config: OverlapConfig | None = None, return_plan: bool = False,
                    expected_rows: int | None = None, call_tag: int = 0,
                    scales: Fp8Scales | None = None, grad_sink: torch.Tensor | None = None):
    """Overlapped GEMM2 + top-k combine + reduce-scatter; returns this rank's [M/D, N].

    Args:
        x: [T, K] expert-sorted activations (bf16, fp16 or fp32; e4m3 with `scales`),
            rows of expert 0 first.
        weight: [E, N, K] FC2 weights of the local experts (nn.Linear layout), x's dtype.
        tokens_per_expert: [E] rows per local expert: a host list / CPU tensor (exact
            planning) or an int32 / int64 CUDA tensor (the planner's normalized-load
            estimate; the host never waits for the counts). Device counts are read in
            place by the routing-table kernel, which checks their sum against T and
            raises (ValueError) as for token_index below.
        token_index: [T] int, the global token (0..M-1) of each row (Megatron's
            `reversed_local_input_permutation_mapping`), in Megatron's permutation
            order: strictly ascending inside each expert's rows. Checked on CPU at the
            call; on CUDA by the routing-table kernel, raised (ValueError) at the next
            call or `OverlapSession.check()` (at once with `sync_errors=True`).
        num_tokens: M, tokens of the whole group; must be divisible by the group size.
        topk: most rows a token can have on this rank (the router's top-k).
        probs: optional [T] weight of each row, applied before the combine (Megatron
            applies routing probabilities before FC2 and passes None).
        group: the reduce-scatter group (Megatron's tp_ep_group); None = one rank.
        comm_ctas, splits: explicit C and L (override the planner / default).
        config: OverlapConfig (backend, planner switch, sm_margin, preset, ...).
        return_plan: also return the planner's decision (None on the reference path).
        expected_rows: x's rows are a bound: the counts may sum to fewer, and the rows
            past their sum are padding, computed and combined by nobody (the layer's
            padded permutation under EP in inference). The value is the rows the
            planner expects where the counts stay on the device (e.g. M x top-k x local
            / all experts under uniform routing). Not with gradients.
        call_tag: an int in [0, 2**15) that every rank of the group passes alike for the
            same call (OverlapMoELayer: its layer and its call count). Calls whose tags
            differ do not pair: every rank raises OverlapMismatchError for them. Calls
            pair in order, so without tags a rank that skipped a call and makes its next
            one before its peers' wait ran out pairs it with their skipped one, a wrong
            result on both; with tags both raise, and the next call alike runs.
        scales: `Fp8Scales(kind, x_scale_inv, w_scale_inv)` where x and weight are FP8
            (TE's data viewed as float8_e4m3fn; kind "tensor" or "block", the layouts of
            kernels/gemm2_fp8.py): GEMM2 dequantizes in its fp32 accumulation and the
            output is bf16. The FP8 operands carry no gradient (ValueError if they
            require one).
        grad_sink: in training, where GEMM2's backward is the caller's (an FP8 recipe's
            formats; blockwise's dequantized bf16 operands): [T, N], the output of the
            caller's own node for GEMM2 (TE's GroupedLinear with its forward GEMM
            skipped, `block_expert_linear(compute=False)`; its values are never read).
            The op's backward hands it dL/dy (each row's token gradient, probs applied)
            and that node runs dgrad and wgrad; probs get their gradient from y. x and
            weight then must not require grad. None with FP8 operands: no gradient
            reaches x and W.

    CUDA graphs: a call captured under torch.no_grad with tokens_per_expert a CUDA
    tensor and a Triton backend replays correctly for whatever the captured x, counts
    and token_index hold at replay time (the planner's decision is the capture's: it
    read only the shapes); on a group of several ranks every rank replays its graph as
    it would call the op. Run one call of the same shapes before capturing (it sets up
    the group's peer memory, and compiles the kernels where `OverlapSession.warm_up` has
    not: a captured call whose kernels are not compiled raises RuntimeError). A
    replay's errors (bad counts, a time-out) stay in the buffer's error word:
    `note_replays()` (or the session's) after a replay reads them at the next call, as
    an eager call's. Other calls raise RuntimeError when captured.
    """
    return default_session(group, x.device)(
        x, weight, tokens_per_expert, token_index, num_tokens, topk, probs,
        comm_ctas=comm_ctas, splits=splits, config=config, return_plan=return_plan,
        expected_rows=expected_rows, call_tag=call_tag, scales=scales, grad_sink=grad_sink)
