"""OverlapMoELayer: Megatron-Core's MoELayer with FC2 + unpermute + reduce-scatter fused.

With the allgather token dispatcher, stock `MoELayer.forward` runs
    routed_experts_compute: dispatch_postprocess -> experts (FC1, act, FC2) -> combine_preprocess
    combine:                token_combine (reduce-scatter over tp_ep_group)
This subclass overrides exactly those two steps: FC1 + activation stay the experts' own
(stock SequentialMLP or GroupedGemmExperts), and FC2, the top-k unpermute and the
reduce-scatter become one `gemm2_gather_rs` call whose output is what `token_combine`
returns. Where the fused op runs, the layer also leaves the GPU idle less often
(`dispatch.py`): the dispatcher's postprocess syncs the host once instead of three
times (same rows, same bits), or never where every expert is local or, in inference
under EP, the rows are padded to a bound: the op takes the expert counts on the device
and skips the padding (`OverlapConfig.host_counts` waits for them instead). In
inference (eval mode, no gradient) the weighted SwiGLU is one Triton pass, and a gated
shared expert's gate and add into the routed output are one more
(`kernels/gated_add.py`). Router, dispatch and the shared experts' GEMMs are Megatron's.

Where the host never waits (inference, device counts: `_capture_refusal`), a forward
captured into a CUDA graph (`torch.cuda.graph`) captures the fused path, at any size,
and replays it on whatever tokens the graph's input then holds; the stock
dropless layer syncs the host and cannot be captured. Anything else (another
dispatcher, TE experts, fp8, expert biases, latent MoE, the inference dispatcher, a
capture the op could not replay) runs the stock path after one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from itertools import chain

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from ..ops import (ExpertWeightStack, OverlapConfig, add_gated_shared_, capturing,
                   fusion_decision, gemm2_gather_rs, interpreting)
from .dispatch import deferred_postprocess, rows_bound, single_sync_postprocess
from .experts import host_counts, in_inference, needs_host_counts, te_fc1_is_grouped
from .fc2_operands import OperandStacks, fc2_operands, pack_expert_weights, unsupported_experts

log = logging.getLogger("megatron_overlap.mcore")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"megatron-overlap: {message}")


class OverlapMoELayer(MoELayer):
    """MoELayer whose GEMM2 + combine + reduce-scatter run overlapped (see module doc).

    Args: those of MoELayer (passed through unchanged), plus
        overlap_config: the OverlapConfig every launch of this layer uses (backend,
            explicit C / L, calibration preset); None = OverlapConfig() (planner, auto
            backend). The spec helpers put it here from the `--moe-overlap-*` flags.

    Attributes:
        overlap_enabled: set False to run the stock path (same weights), e.g. for A/B runs.
        last_plan: the planner's decision of the latest launch (None on the reference
            backend, on the stock path or before the first launch).
        last_rows: the counts (rows per local expert) of the latest fused launch: on the
            host, or a device tensor where the layer kept them there
            (`OverlapConfig.host_counts`).
        last_fusion: the planner's fuse-or-not answer for the latest call
            (`ops.fusion_decision`: both predicted times), None before the first or with
            `OverlapConfig.fuse = "always"`.
        decisions: how many distinct (C, L) or stock-path decisions this layer has logged.

    Before the first call of each size, the layer asks the planner whether the fused op
    beats the stock steps it replaces there (`ops.fusion_decision`, from the device
    calibration's `step_costs`) and runs the path predicted faster; `OverlapConfig.fuse
    = "always"` fuses at every size.
    """

    def __init__(self, *args, overlap_config: OverlapConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if overlap_config is not None and not isinstance(overlap_config, OverlapConfig):
            raise ValueError("overlap_config must be an OverlapConfig, got "
                             f"{type(overlap_config).__name__}")
        self.overlap_config = overlap_config or OverlapConfig()
        self.overlap_enabled = True
        self.last_plan = None
        self.last_rows = None
        self.decisions = 0
        self._unsupported = self._why_unsupported()
        self._stacks = OperandStacks()  # expert weights, stacked once per change
        if self._unsupported is None:
            pack_expert_weights(self.experts)  # (then the stacks are views: no copy at all)
        self._fused_pending = False  # routed_experts_compute already did the combine
        self._routed_by_op = False  # this call's routed output came from the fused op
        self._gated_shared = None  # (shared output before its gate, gate logits) to add
        self._last_key = None
        self.last_fusion = None
        self._fusion: dict[tuple, object] = {}  # the fuse-or-not answer per (tokens, dtype)

    def _why_unsupported(self) -> str | None:
        c = self.config
        if not isinstance(self.token_dispatcher, MoEAllGatherTokenDispatcher):
            name = type(self.token_dispatcher).__name__
            return f"the {name} dispatcher (only allgather is fused)"
        if hasattr(self, "_inference_token_dispatcher"):
            return "transformer_impl='inference_optimized' (its own dispatcher)"
        if c.fp8 or c.fp4:  # (TE's quantized GEMMs: the op's GEMM2 is bf16/fp16/fp32)
            return "fp8/fp4 experts (the fused GEMM2 runs bf16, fp16 or fp32)"
        if (why := unsupported_experts(self.experts)) is not None:
            return why
        if c.moe_latent_size:
            return "latent MoE projections"
        if c.overlap_dispatch_backward_with_experts_wgrad:
            return "overlap_dispatch_backward_with_experts_wgrad"
        return None

    def _use_overlap(self, hidden_states) -> bool:
        """Overlap this call? The same answer on every rank of the group: it reads only
        the gathered [M, H] activations' size, the configuration and the device."""
        if not self.overlap_enabled:
            return False
        if self._unsupported is not None:
            _warn_once(self._unsupported, f"{self._unsupported} is not supported; those MoE "
                       "layers run the stock Megatron path")
            return False
        if capturing(hidden_states):
            why = self._capture_refusal(hidden_states)
            if why is not None:
                _warn_once(f"capture: {why}", "MoE layers captured in a CUDA graph run the "
                           f"stock Megatron path here: {why}")
                return False
            # fused at every size: the stock path (it syncs the host) cannot be captured,
            # and a replay has no host work to save
            return True
        if self.overlap_config.fuse == "always":
            return True
        self.last_fusion = self._fusion_for(hidden_states)
        if not self.last_fusion.fuse:  # the model says the stock path is faster here
            self._note_stock(hidden_states.shape[0], self.last_fusion)
            return False
        return True

    def _fusion_for(self, hidden_states):
        """The planner's fuse-or-not answer for calls of this many tokens (cached)."""
        key = (hidden_states.shape[0], hidden_states.dtype)
        found = self._fusion.get(key)
        if found is None:
            c, local = self.config, self.num_local_experts
            ffn = ((c.moe_ffn_hidden_size or c.ffn_hidden_size)
                   // (c.expert_tensor_parallel_size or 1))
            padded = local != c.num_moe_experts and in_inference(self, (hidden_states,))
            found = fusion_decision(
                num_tokens=key[0], hidden=c.hidden_size, ffn=ffn, topk=c.moe_router_topk,
                local_experts=local, experts=c.num_moe_experts, dtype=key[1],
                device=hidden_states.device, group=self.token_dispatcher.tp_ep_group,
                config=self.overlap_config, stock_launches=self._stock_launches(),
                padded=padded)
            if len(self._fusion) >= 64:  # (bounded: a sweep of sizes)
                self._fusion.clear()
            self._fusion[key] = found
        return found

    def _stock_launches(self) -> int:
        """Kernel launches the stock experts make per call beyond the fused path's: TE's
        GroupedLinear runs one GEMM per local expert in FC2, and in FC1 where the fused
        path groups it (`te_fc1_is_grouped`); a grouped GEMM runs one."""
        if not isinstance(self.experts, TEGroupedMLP):
            return 0
        return self.num_local_experts * (2 if te_fc1_is_grouped(self.experts) else 1)

    def _capture_refusal(self, hidden_states) -> str | None:
        """Why this call, captured into a CUDA graph, could not replay the routing of each
        replay (None: it can). It can where nothing reaches the host: inference, and the
        counts kept on the device
        (`_postprocess`: every expert local, grouped experts, no fused permute, no
        capacity factor)."""
        c = self.config
        if not in_inference(self, chain((hidden_states,), self.parameters())):
            return "gradients (capture the forward in eval mode under torch.no_grad)"
        if self.num_local_experts != c.num_moe_experts and rows_bound(
                hidden_states.shape[0], c.moe_router_topk, self.num_local_experts,
                c.num_moe_experts) is None:
            return ("expert parallelism with a loose bound of the rows (top-k x EP > "
                    "MAX_PADDING x top-k: the rows are counted on the host)")
        if c.moe_permute_fusion or c.moe_expert_capacity_factor:
            return "TE's fused permute or a capacity factor (the rows are split on the host)"
        if needs_host_counts(self.experts, hidden_states):
            return f"{type(self.experts).__name__} experts (they split the rows on the host)"
        if self.overlap_config.host_counts:
            return "OverlapConfig.host_counts"
        return None

    def _note_stock(self, tokens: int, decision) -> None:
        key = ("stock", tokens)
        if key == self._last_key:
            return
        self._last_key = key
        self.last_plan = None
        self.decisions += 1
        log.info("moe-overlap layer %s: stock path for %d tokens, predicted %.1f us fused "
                 "against %.1f us unfused", self.layer_number, tokens, decision.fused_us,
                 decision.unfused_us)

    def _postprocess(self, hidden_states, probs):
        """(tokens_per_expert, FC1 + activation output, FC2 weight, expected rows) of the
        dispatched tokens: Megatron's postprocess where TE permutes, else one sync
        (`single_sync_postprocess`) or, where the row count is known or (in inference)
        bounded without the counts, none before FC1 is queued (`deferred_postprocess`).
        The counts are on the host, or on the device: where FC1 runs on device offsets,
        the config does not ask for host counts (`OverlapConfig.host_counts`), and either
        every expert is on this rank (the rows are M x top-k, known without the counts;
        `deferred_postprocess` checks that no capacity factor drops any) or, in inference
        under EP, the rows are padded to their bound (the op's `expected_rows`: a uniform
        routing's rows, for its plan). The op then takes them there and the host never
        waits for them. Expected rows is None unless the rows are padded."""
        disp, c = self.token_dispatcher, self.config
        topk, local = c.moe_router_topk, self.num_local_experts
        pad = in_inference(self, chain((hidden_states, probs), self.experts.parameters()))
        # (the permuted rows have hidden_states' dtype and device, and rows iff it has)
        fc1_first = not needs_host_counts(self.experts, hidden_states)
        on_device = (fc1_first and not self.overlap_config.host_counts
                     and (local == c.num_moe_experts or pad))
        deferred = None if self.config.moe_permute_fusion else deferred_postprocess(
            disp, hidden_states, probs, topk, pad=pad, host_copy=not on_device)
        if deferred is not None:
            x, permuted_probs = deferred.permuted, deferred.probs
            h = weight = None
            if fc1_first:  # FC1 queued before the wait
                h, weight = fc2_operands(self.experts, self._stacks, x, None, permuted_probs,
                                         deferred.counts_dev, deferred.valid_rows)
                if on_device:  # the rows are M x top-k, or padded: the device counts
                    expected = None
                    if local != c.num_moe_experts:  # (uniform routing's rows, for the plan)
                        expected = min(x.shape[0], hidden_states.shape[0] * topk * local
                                       // c.num_moe_experts)
                    return deferred.counts_dev, h, weight, expected
            tokens_per_expert = deferred.tokens_per_expert()
            rows = int(tokens_per_expert.sum())
            if rows == x.shape[0] or (deferred.padded and rows < x.shape[0]):
                deferred.trim(disp, rows)  # the padding's rows (FC1 skipped them) go
                if h is None:
                    h, weight = fc2_operands(self.experts, self._stacks, deferred.permuted,
                                             tokens_per_expert, deferred.probs)
                return tokens_per_expert, h[:rows], weight, None
            # a router that gave some token fewer than top-k experts, where rows may not
            # be padded (a gradient flows): redo with the counts
            disp.routing_map = deferred.routing_map
        if self.config.moe_permute_fusion:
            x, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(hidden_states,
                                                                             probs)
        else:
            x, tokens_per_expert, permuted_probs = single_sync_postprocess(disp, hidden_states,
                                                                           probs)
        h, weight = fc2_operands(self.experts, self._stacks, x, tokens_per_expert, permuted_probs)
        return tokens_per_expert, h, weight, None

    def _fuses_shared_gate(self, hidden_states) -> bool:
        """Join a gated shared expert to the routed output in one pass (`add_gated_shared_`)?
        Where the overlap may run, in inference (`in_inference`), on CUDA or
        under the interpreter, with Megatron's plain shared expert (not its own overlap),
        without CUDA graphs (TE's partial capture replays a stored, gated output), and in
        one forward call (not split into steps that other calls may interleave: the
        ungated output waits on this layer between its steps)."""
        steps = getattr(self, "fwd_execution_map", ())  # a list, or one step's name
        if not (self.overlap_enabled and self._unsupported is None and self.use_shared_expert
                and not self.shared_expert_overlap and not self.shared_experts_recompute
                and getattr(self.shared_experts, "use_shared_expert_gate", False)
                and getattr(self.config, "cuda_graph_impl", "none") == "none"
                and not isinstance(steps, str)
                and {"route", "expert_compute", "postprocess"} <= set(steps)):
            return False
        return (in_inference(self, chain((hidden_states,), self.shared_experts.parameters()))
                and (hidden_states.is_cuda or interpreting()))

    def shared_experts_compute(self, hidden_states):
        """Stock, except where the gate fuses into the add (`_fuses_shared_gate`): the shared
        expert runs without its gate, and `postprocess` joins it to the routed output."""
        self._gated_shared = None
        if not self._fuses_shared_gate(hidden_states):
            return super().shared_experts_compute(hidden_states)
        experts = self.shared_experts
        experts.use_shared_expert_gate = False  # the module call as Megatron makes it, ungated
        try:
            ungated = super().shared_experts_compute(hidden_states)
        finally:
            experts.use_shared_expert_gate = True
        logits = torch.nn.functional.linear(hidden_states, experts.gate_weight)
        self._gated_shared = (ungated, logits)
        return None

    def postprocess(self, output, shared_expert_output):
        """Stock, plus the gated shared expert `shared_experts_compute` left ungated: one pass
        into the fused op's fresh output, else Megatron's multiply and add (its bits)."""
        pending, self._gated_shared = self._gated_shared, None
        if pending is None or shared_expert_output is not None:  # (stale: a failed call's)
            return super().postprocess(output, shared_expert_output)
        ungated, logits = pending
        output = super().postprocess(output, None)
        if (self._routed_by_op and output.dtype == ungated.dtype and output.is_contiguous()
                and ungated.is_contiguous()):
            return add_gated_shared_(output, ungated, logits)
        return output + ungated * torch.sigmoid(logits)

    def routed_experts_compute(self, hidden_states, probs):
        """Stock: expert output before combine. Overlapped: the combined [M/D, H] rows."""
        self._routed_by_op = self._use_overlap(hidden_states)
        if not self._routed_by_op:
            self._fused_pending = False
            return super().routed_experts_compute(hidden_states, probs)
        disp = self.token_dispatcher
        tokens_per_expert, h, weight, expected_rows = self._postprocess(hidden_states, probs)
        if self.config.moe_permute_fusion:
            # TE's fused permute keeps a row-id map, not the token of each row: rebuild the
            # expert-major, token-ascending order it permuted in.
            token_index = disp.local_map.T.nonzero()[:, 1]
        else:
            token_index = disp.reversed_local_input_permutation_mapping
        num_tokens = disp.hidden_shape_before_permute[0]
        # probs are already in h (the activation applied them, as Megatron's experts do).
        out, plan = gemm2_gather_rs(h, weight.to(h.dtype), tokens_per_expert, token_index,
                                    num_tokens, self.config.moe_router_topk, None,
                                    disp.tp_ep_group, config=self.overlap_config,
                                    return_plan=True, expected_rows=expected_rows)
        self._note_decision(plan, tokens_per_expert, num_tokens, weight, disp.tp_ep_group)
        self._fused_pending = True
        return out, None

    def combine(self, output):
        """Stock reduce-scatter, unless routed_experts_compute already combined."""
        if self._fused_pending:
            self._fused_pending = False
            return output
        return super().combine(output)

    def _note_decision(self, plan, tokens_per_expert, m, weight, group) -> None:
        """INFO line on this layer's first launch and whenever (C, L) changes."""
        self.last_plan = plan
        self.last_rows = tokens_per_expert  # this rank's experts' (host or device) counts
        key = ("reference",) if plan is None else (plan.comm_ctas, plan.splits)
        if key == self._last_key:
            return
        self._last_key = key
        self.decisions += 1
        if not log.isEnabledFor(logging.INFO):
            return
        e, n, k = weight.shape
        d = group.size() if group is not None else 1
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.is_cuda:
            load = "counts on the device"  # (reading them would sync the host)
        else:
            counts = host_counts(tokens_per_expert)
            load = f"rows={sum(counts)} max_e={max(counts, default=0)}"
        sig = f"M={m} N={n} K={k} D={d} E={e} {load}"
        if plan is None:
            log.info("moe-overlap layer %s: reference backend (not overlapped), %s",
                     self.layer_number, sig)
        else:
            # R = 0: the shared placement (communication CTAs beside GEMM2's)
            log.info("moe-overlap layer %s: C=%d R=%d L=%d P=%d predicted T=%.1f (%s), %s",
                     self.layer_number, plan.comm_ctas, plan.reservation, plan.splits,
                     plan.compute_slots, plan.predicted, plan.source, sig)


def overlap_layers(model) -> list:
    """Every OverlapMoELayer of `model`, in order."""
    return [m for m in model.modules() if isinstance(m, OverlapMoELayer)]


def set_overlap_enabled(model, enabled: bool) -> int:
    """Turn the overlap of every OverlapMoELayer in `model` on or off; returns their count."""
    layers = overlap_layers(model)
    for layer in layers:
        layer.overlap_enabled = enabled
    return len(layers)


@contextlib.contextmanager
def fused_at_every_size(model):
    """Every OverlapMoELayer in `model` overlapped and runs the fused op whatever its size,
    as a CUDA-graph capture runs them: the eager forward a replay is checked against."""
    layers = overlap_layers(model)
    enabled = [(layer.overlap_enabled, layer.overlap_config) for layer in layers]
    for layer in layers:
        layer.overlap_enabled = True
        layer.overlap_config = dataclasses.replace(layer.overlap_config, fuse="always")
    try:
        yield
    finally:
        for layer, (on, config) in zip(layers, enabled):
            layer.overlap_enabled, layer.overlap_config = on, config
