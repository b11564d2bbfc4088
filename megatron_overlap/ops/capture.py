"""One call captured into a CUDA graph and checked against its eager output: what the
benchmarks and the prefill time where the host is taken out of a forward.

A capture records the kernels of one call with the arguments they had; a replay re-runs
them on the same tensors. The op replays correctly only where nothing the host prepares
per call reaches its kernels (`validation.capture_refusal`), and it needs one eager call
first (its buffer and peer memory are set up outside any capture).
"""

from __future__ import annotations

from typing import Callable

import torch



class CapturedCall:
    """`fn` (returning one floating tensor) captured into one CUDA graph on `device`.

    `reference`: the eager output the replay must reproduce (default: `fn()` called once
    eagerly here, which is also the eager call the op needs before a capture). `error`:
    why the capture failed (a CUDA error of the capture, OOM, a refusal of the op), in
    which case there is nothing to replay. `sessions`: the op sessions whose calls `fn`
    makes besides the default ones (`gemm2_gather_rs`'s): each replay raises what an
    earlier replay's kernels recorded there, as an eager call would. The replay is checked right after the capture:
    the output poisoned with NaN first, then compared with the reference in chunks (a
    prefill's logits are as large as the graph's own); the reference is then freed.

    The graph's kernels read and write the addresses `fn`'s tensors had at capture, so
    `fn` (and with it every tensor its closure holds) lives as long as the graph: a
    tensor made only for the call and freed after it would go back to the caching
    allocator, and a replay would read whatever reused its memory. (`bench_op
    --cuda-graph` once did: its expert counts were freed, an eager policy took their
    block, and the replayed grouped GEMM failed torch's offsets assert.)
    """

    def __init__(self, fn: Callable[[], torch.Tensor], device, reference=None, sessions=()):
        self.device, self.graph, self.out, self.error, self.check = device, None, None, None, {}
        self.sessions = tuple(sessions)
        self._fn = fn  # owns the inputs the graph reads (see above)
        with torch.no_grad():
            eager = fn() if reference is None else reference
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.out = fn()
            except Exception as err:  # a result to report, not a crash of the benchmark
                self.error = f"{type(err).__name__}: {err}"[:400]
                self.out = None
                torch.cuda.synchronize(device)
                return
            self.graph = graph
            self.check = self._compare(eager)

    def replay(self) -> None:
        self.graph.replay()
        from .session import note_replays  # (the session imports the op; capture serves both)

        note_replays(self.device)  # a replay's kernel errors, raised as an eager call's
        for session in self.sessions:
            session.note_replays()

    def _compare(self, eager: torch.Tensor) -> dict:
        """The same kernels with the same plans give the same bits, unless a library chose
        another algorithm inside the capture: `equal`, and the largest difference relative
        to the reference's largest magnitude, in fp32."""
        self.out.fill_(float("nan"))
        self.replay()
        torch.cuda.synchronize(self.device)
        diff = scale = 0.0
        unwritten = False
        chunks = min(64, max(1, self.out.shape[0])) if self.out.dim() else 1
        for got, want in zip(self.out.reshape(-1).chunk(chunks), eager.reshape(-1).chunk(chunks)):
            unwritten = unwritten or bool(got.isnan().any())
            diff = max(diff, float((got.float() - want.float()).abs().max()))
            scale = max(scale, float(want.float().abs().max()))
        return dict(captured=True, equal=bool(torch.equal(self.out, eager)),
                    all_written=not unwritten, max_rel_diff=diff / scale if scale else diff)

    def summary(self) -> dict:
        """The replay's check, or why the capture failed."""
        return dict(captured=False, error=self.error) if self.error is not None else self.check

    def release(self) -> None:
        self.graph = self.out = self._fn = None
        torch.cuda.empty_cache()
