"""OverlapMoELayer: Megatron-Core's MoELayer with FC2 + unpermute + reduce-scatter fused.

With the allgather token dispatcher, stock `MoELayer.forward` runs
    routed_experts_compute: dispatch_postprocess -> experts (FC1, act, FC2) -> combine_preprocess
    combine:                token_combine (reduce-scatter over tp_ep_group)
This subclass overrides exactly those two steps: FC1 + activation stay the experts' own
(stock SequentialMLP or GroupedGemmExperts), and FC2, the top-k unpermute and the
reduce-scatter become one `gemm2_gather_rs` call whose output is what `token_combine`
returns: permute (the dispatcher's `Permuted`) -> FC1 -> the op. Where the fused op
runs, the layer also leaves the GPU idle less often: its dispatcher
(`dispatch.OverlapAllGatherDispatcher`, installed over Megatron's allgather one) syncs
the host once instead of three times (same rows, same bits), or never where every
expert is local or, in inference under EP, the rows are padded to a bound: the op takes
the expert counts on the device and skips the padding (`LayerPolicy.host_counts`
waits for them instead). In inference (eval mode, no gradient) the weighted SwiGLU is
one Triton pass, and a gated shared expert's gate and add into the routed output are
one more (`kernels/gated_add.py`). Router, dispatch and shared experts are Megatron's.

Where the host never waits (inference, device counts: `support.capture_refusal`), a forward
captured into a CUDA graph (`torch.cuda.graph`) captures the fused path, at any size,
and replays it on whatever tokens the graph's input then holds; the stock dropless
layer syncs the host and cannot be captured. Anything else (another dispatcher, fp8,
latent MoE, the inference dispatcher, experts `unsupported_experts` refuses, a capture
the op could not replay) runs the stock path after one warning.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from itertools import chain

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..ops import (OverlapConfig, OverlapSession, block_dequantized, capturing, default_session,
                   fusion_decision)
from .dispatch import Deferred, OverlapAllGatherDispatcher, Permuted
from .decision_log import launch_line
from .experts import in_inference, needs_host_counts
from .fc2_operands import FC2Operands, OperandStacks, fc2_operands, pack_expert_weights
from .fp8_experts import block_gradients, grouped_fp8_note
from .te_fp8 import autocast_refusal, recipe_kind
from .policy import LayerPolicy
from .shared_gate import gate_joins, join
from .support import capture_refusal, stock_launches, unsupported_reason, warmed

log = logging.getLogger("megatron_overlap.mcore")
_warned: set[str] = set()

#: The installed dispatcher's postprocesses, called by these names (tests replace them to
#: switch one off or break its top-k).
deferred_postprocess = OverlapAllGatherDispatcher.deferred_postprocess
single_sync_postprocess = OverlapAllGatherDispatcher.single_sync_postprocess


@dataclass(frozen=True)
class CallPath:
    """How one forward call of the layer runs, decided once, at its routed step, from the
    dispatched rows: every step after it reads this value instead of asking again."""

    fused: bool  # the op does FC2 + unpermute + reduce-scatter (else Megatron's stock steps)
    inference: bool  # eval mode, no gradient through the rows, probs or experts: padding,
    #                  counts left on the device, one-pass kernels
    host_counts: bool  # FC1 of these experts splits the rows on the host
    grouped_fp8: bool = False  # FP8 experts on the grouped FP8 path (fp8_experts.py)


@dataclass
class _InFlight:
    """What one forward call hands from one of Megatron's steps to a later one: made at
    its first step, dropped at its last (`postprocess`), so no call sees another's."""

    path: CallPath | None = None
    gated_shared: tuple | None = None  # (shared output before its gate, gate logits)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"megatron-overlap: {message}")


def checked_overlap_args(overlap_config, policy) -> tuple:
    """(overlap_config, policy) as given, each None or of its type, else a ValueError
    naming it (the layer, the spec helpers and `overlap_moe_layers` take both)."""
    if overlap_config is not None and not isinstance(overlap_config, OverlapConfig):
        raise ValueError("overlap_config must be an OverlapConfig, got "
                         f"{type(overlap_config).__name__}")
    if policy is not None and not isinstance(policy, LayerPolicy):
        raise ValueError(f"policy must be a LayerPolicy, got {type(policy).__name__}")
    return overlap_config, policy


class OverlapMoELayer(MoELayer):
    """MoELayer whose GEMM2 + combine + reduce-scatter run overlapped (see module doc).

    Args: those of MoELayer (passed through unchanged), plus
        overlap_config: the OverlapConfig every launch of this layer uses (backend,
            explicit C / L, calibration preset); None = OverlapConfig() (planner, auto
            backend). The spec helpers put it here from the `--moe-overlap-*` flags.
        policy: the layer's own LayerPolicy (fuse or not per size, host counts); None =
            LayerPolicy().

    Attributes:
        overlap_enabled: set False to run the stock path (same weights), e.g. for A/B runs.
        last_plan: the planner's decision of the latest launch (None on the reference
            backend, on the stock path or before the first launch).
        last_rows: the counts (rows per local expert) of the latest fused launch: on the
            host, or a device tensor where the layer kept them there
            (`LayerPolicy.host_counts`).
        last_fusion: the planner's fuse-or-not answer for the latest call
            (`ops.fusion_decision`: both predicted times), None before the first or with
            `LayerPolicy.fuse = "always"`.
        decisions: how many distinct (C, L) or stock-path decisions this layer has logged.
        unsupported_reason: why this layer runs the stock path at every size (known at
            build: another dispatcher, fp8, a width the op cannot read, ...), or None.

    Before the first call of each size, the layer asks the planner whether the fused op
    beats the stock steps it replaces there (`ops.fusion_decision`, from the device
    calibration's `step_costs`) and runs the path predicted faster; `LayerPolicy.fuse =
    "always"` fuses at every size.
    """

    def __init__(self, *args, overlap_config: OverlapConfig | None = None,
                 policy: LayerPolicy | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._adopt(overlap_config, policy)

    @classmethod
    def adopt(cls, layer: MoELayer, overlap_config: OverlapConfig | None = None,
              policy: LayerPolicy | None = None) -> "OverlapMoELayer":
        """`layer`, a built megatron.core MoELayer, made an OverlapMoELayer in place: the
        same module, parameters, process groups and dispatcher object, so a model built by
        any Megatron builder (GPT, its MTP block, HybridModel, a user's spec) changes no
        weight, no state-dict key and no initialization when its MoE layers are adopted
        (`overlap_moe_layers`). Only an exact MoELayer is adopted (a subclass may have
        moved the two override points: ValueError); an OverlapMoELayer gets the new
        config and policy, and its support is decided again (the backend may differ)."""
        if not isinstance(layer, OverlapMoELayer):
            if type(layer) is not MoELayer:
                raise ValueError(f"cannot adopt the custom MoE class "
                                 f"{type(layer).__qualname__}; only megatron.core MoELayer "
                                 "becomes an OverlapMoELayer")
            layer.__class__ = cls  # (Megatron's __init__ ran; ours runs below)
        layer._adopt(overlap_config, policy)
        return layer

    def _adopt(self, overlap_config, policy) -> None:
        """The overlap's state on a layer whose MoELayer.__init__ has run."""
        overlap_config, policy = checked_overlap_args(overlap_config, policy)
        self.overlap_config = overlap_config or OverlapConfig()
        self.policy = policy or LayerPolicy()
        self.overlap_enabled = True
        self.last_plan = None
        self.last_rows = None
        self.decisions = 0
        self.unsupported_reason = unsupported_reason(self)
        self._grouped = grouped_fp8_note(self)  # (the grouped FP8 experts' calls)
        #: why this fused FP8 layer's inference / training keeps TE's GroupedLinear (None:
        #: the grouped FP8 experts take it, or the layer is not fused in FP8), said at build
        self.grouped_fp8_refusal = self._grouped.inference_refusal
        self.grouped_fp8_training_refusal = self._grouped.training_refusal
        self._stacks = OperandStacks()  # expert weights, stacked once per change
        self.overlap_session = None
        if self.unsupported_reason is None:
            # the op's state (peer memory, plans, compiled kernels), shared by the group's
            # layers; made here, on every rank together (it asks the group its hosts),
            # with the kernels this layer launches compiled
            self.overlap_session = warmed(self, default_session(
                self.token_dispatcher.tp_ep_group))
            # Megatron's own dispatcher object, with the process groups it was built with,
            # gains the fused path's methods (the class adds no state: dispatch.py)
            self.token_dispatcher.__class__ = OverlapAllGatherDispatcher
            pack_expert_weights(self.experts)  # (then the stacks are views: no copy at all)
        self._fused_calls = 0  # (the op's call tags: `_call_tag`)
        self._in_flight: _InFlight | None = None  # the call between Megatron's steps
        self.last_path: CallPath | None = None  # the latest call's (a record, as last_plan)
        self._last_key = None
        self.last_fusion = None
        self._fusion: dict[tuple, object] = {}  # fuse-or-not per (tokens, dtype, TE unpermute)

    def _path(self, hidden_states, probs) -> CallPath:
        """This call's path, from the dispatched rows [M, H] and their probs."""
        rows = (hidden_states,) if probs is None else (hidden_states, probs)
        inference = in_inference(self, chain(rows, self.experts.parameters()))
        grouped_fp8 = self._grouped.takes(self.experts, inference, hidden_states.dtype)
        host = needs_host_counts(self.experts, hidden_states, grouped_fp8)
        return CallPath(self._fuses(hidden_states, inference, host, grouped_fp8), inference,
                        host, grouped_fp8)

    def _fuses(self, hidden_states, inference: bool, host_counts: bool,
               grouped_fp8: bool = False) -> bool:
        """Overlap this call? The same answer on every rank of the group: it reads only
        the gathered [M, H] activations' size, the configuration and the device."""
        if not self.overlap_enabled:
            return False
        if self.unsupported_reason is not None:
            _warn_once(self.unsupported_reason, f"{self.unsupported_reason} is not supported; those MoE "
                       "layers run the stock Megatron path")
            return False
        if (why := autocast_refusal(self.experts)) is not None:
            _warn_once(why, f"{why}: those calls run the stock Megatron path")
            return False
        if capturing(hidden_states):
            why = capture_refusal(self, hidden_states, host_counts)
            if why is not None:
                _warn_once(f"capture: {why}", "MoE layers captured in a CUDA graph run the "
                           f"stock Megatron path here: {why}")
                return False
            # fused at every size: the stock path (it syncs the host) cannot be captured,
            # and a replay has no host work to save
            return True
        if self.policy.fuse == "always":
            return True
        self.last_fusion = self._fusion_for(hidden_states, inference, grouped_fp8)
        if not self.last_fusion.fuse:  # the model says the stock path is faster here
            self._note_stock(hidden_states.shape[0], self.last_fusion)
            return False
        return True

    def _fusion_for(self, hidden_states, inference: bool, grouped_fp8: bool = False):
        """The planner's fuse-or-not answer for calls of this many tokens (cached), against
        the stock path as it runs here: TE's fused unpermute under `moe_permute_fusion`
        (read per call, as Megatron's dispatcher reads it); FP8 experts priced with their
        recipe's kernel family, and on the grouped FP8 path stock's per-expert FC1 and
        quantization launches too."""
        te_unpermute = bool(self.config.moe_permute_fusion)
        key = (hidden_states.shape[0], hidden_states.dtype, te_unpermute, grouped_fp8)
        found = self._fusion.get(key)
        if found is None:
            c, local = self.config, self.num_local_experts
            ffn = ((c.moe_ffn_hidden_size or c.ffn_hidden_size)
                   // (c.expert_tensor_parallel_size or 1))
            padded = local != c.num_moe_experts and inference
            found = fusion_decision(
                session=self._session_on(hidden_states.device), num_tokens=key[0], hidden=c.hidden_size, ffn=ffn, topk=c.moe_router_topk,
                local_experts=local, experts=c.num_moe_experts, dtype=key[1],
                device=hidden_states.device, group=self.token_dispatcher.tp_ep_group,
                config=self.overlap_config, stock_launches=stock_launches(self, grouped_fp8),
                padded=padded, stock_permute_fused=te_unpermute,
                fp8=None if grouped_fp8 and self._grouped.kind == "block" else recipe_kind(c))
            if len(self._fusion) >= 64:  # (bounded: a sweep of sizes)
                self._fusion.clear()
            self._fusion[key] = found
        return found

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

    def _permute(self, hidden_states, probs, path: CallPath) -> Permuted | Deferred:
        """The dispatched rows sorted by local expert: where the rows are known or (in
        inference) bounded without the counts, a postprocess not waiting for them
        (`Deferred`), which keeps them on the device where FC1 runs on device offsets,
        `LayerPolicy.host_counts` is off and every expert is local (M x top-k rows) or
        the rows are padded; else one sync. Whatever `moe_permute_fusion` says: TE's
        fused permute syncs the host twice (the counts, its probabilities' selection)
        and keeps no token of each row, which the op would rebuild with one more sync
        (`Permuted.token_index`); ours gives the op the tokens at one sync or none (on one
        H200, Granite 4 x 16384 prefill: 302 ms against 322 ms with TE's)."""
        disp, c, pad = self.token_dispatcher, self.config, path.inference
        # (the permuted rows have hidden_states' dtype and device, and rows iff it has)
        on_device = (not path.host_counts and not self.policy.host_counts
                     and (self.num_local_experts == c.num_moe_experts or pad))
        # (the grouped FP8 path reads the rows by their tokens while quantizing them in
        # inference; in training the permutation's backward is the gathered rows')
        gather = not (on_device and path.grouped_fp8 and pad and self._grouped.kind == "tensor"
                      and not c.moe_apply_probs_on_input)
        deferred = deferred_postprocess(disp, hidden_states, probs, c.moe_router_topk,
                                        pad=pad, host_copy=not on_device, gather=gather)
        return self._one_sync(hidden_states, probs) if deferred is None else deferred

    def _one_sync(self, hidden_states, probs) -> Permuted:
        disp = self.token_dispatcher
        return disp.permuted(*single_sync_postprocess(disp, hidden_states, probs),
                             te_row_map=False)

    def _fc1(self, permuted, hidden_states, probs, path: CallPath
             ) -> tuple[Permuted, FC2Operands]:
        """(the rows as the op takes them, FC1 + activation and the FC2 weight). A
        deferred permutation's FC1 is queued before the host waits for the counts where
        the experts run on device offsets (no wait where the counts stay there); the wait
        trims the padding, or, where the counts do not fit the rows (a router gave some
        token fewer than top-k experts, and a gradient flows), it is redone with them."""
        if isinstance(permuted, Permuted):
            return permuted, self._operands(permuted, path)
        deferred, disp, early = permuted, self.token_dispatcher, None
        if not path.host_counts:  # FC1 before the wait
            ungathered = deferred.permuted is None
            early = fc2_operands(self.experts, self._stacks,
                                 deferred.source if ungathered else deferred.permuted, None,
                                 deferred.probs, deferred.counts_dev, deferred.valid_rows,
                                 token_index=deferred.token_index if ungathered else None,
                                 grouped_fp8=path.grouped_fp8)
            if not deferred.host_copy:
                return disp.permuted_on_device(deferred), early
        settled = disp.settle(deferred)
        if settled is None:
            settled, early = self._one_sync(hidden_states, probs), None
        if early is None:
            return settled, self._operands(settled, path)
        rows = settled.rows.shape[0]
        sink = None if early.sink is None else early.sink[:rows]
        return settled, early._replace(h=early.h[:rows], sink=sink)

    def _operands(self, permuted: Permuted, path: CallPath) -> FC2Operands:
        return fc2_operands(self.experts, self._stacks, permuted.rows, permuted.counts,
                            permuted.probs, grouped_fp8=path.grouped_fp8)

    def _fuses_shared_gate(self, hidden_states) -> bool:
        """Join the gated shared expert to the routed output in one pass this call?"""
        return gate_joins(self, hidden_states)

    def shared_experts_compute(self, hidden_states):
        """Stock, except where the gate fuses into the add (`_fuses_shared_gate`): the shared
        expert runs without its gate, and `postprocess` joins it to the routed output."""
        self._in_flight = _InFlight()  # (a forward call starts at this step: `route`)
        if not self._fuses_shared_gate(hidden_states):
            return super().shared_experts_compute(hidden_states)
        experts = self.shared_experts
        experts.use_shared_expert_gate = False  # the module call as Megatron makes it, ungated
        try:
            ungated = super().shared_experts_compute(hidden_states)
        finally:
            experts.use_shared_expert_gate = True
        logits = torch.nn.functional.linear(hidden_states, experts.gate_weight)
        self._in_flight.gated_shared = (ungated, logits)
        return None

    def postprocess(self, output, shared_expert_output):
        """Stock, plus the gated shared expert `shared_experts_compute` left ungated: one pass
        into the fused op's fresh output, else Megatron's multiply and add (its bits)."""
        flight, self._in_flight = self._in_flight, None
        pending = flight.gated_shared if flight is not None else None
        if pending is None or shared_expert_output is not None:  # (stale: a failed call's)
            return super().postprocess(output, shared_expert_output)
        ungated, logits = pending
        output = super().postprocess(output, None)
        return join(output, ungated, logits, flight.path is not None and flight.path.fused)

    def routed_experts_compute(self, hidden_states, probs):
        """Stock: expert output before combine. Overlapped: the combined [M/D, H] rows, as
        permute (the dispatcher) -> FC1 + activation (the experts) -> the fused op."""
        flight = self._in_flight
        if flight is None or flight.path is not None:  # (no route step in this call)
            flight = self._in_flight = _InFlight()
        path = flight.path = self.last_path = self._path(hidden_states, probs)
        if not path.fused:
            return super().routed_experts_compute(hidden_states, probs)
        if (path.grouped_fp8 and self._grouped.kind == "block"
                and not block_gradients(self.experts, hidden_states)):
            # (TE's 1x128 blocks lie within a row: each token through them once, before
            # its top-k copies, instead of every copy; in training FC1's node blocks the
            # rows and keeps them raw for its wgrad: own_block_operands)
            hidden_states = block_dequantized(hidden_states)
        permuted, operands = self._fc1(self._permute(hidden_states, probs, path),
                                       hidden_states, probs, path)
        h, weight = operands.h, operands.weight
        # probs are already in h (the activation applied them, as Megatron's experts do).
        try:
            out, plan = self._session_on(h.device)(
                h, weight.to(h.dtype), permuted.counts, permuted.token_index,
                permuted.num_tokens, self.config.moe_router_topk, None,
                config=self.overlap_config, return_plan=True,
                expected_rows=permuted.expected_rows, call_tag=self._call_tag(),
                scales=operands.scales, grad_sink=operands.sink)
        except Exception:
            # every rank raises for a fault or its next call: the counts restart, and meet
            # again after at most one more mismatch
            self._fused_calls = 0
            raise
        self._note_decision(plan, permuted, weight)
        return out, None

    def _session_on(self, device) -> OverlapSession:
        """The layer's op session, on the device its activations are on (a model built
        on one device and moved to another gets the group's session there)."""
        if self.overlap_session is None or self.overlap_session.device != device:
            self.overlap_session = warmed(self, default_session(
                self.token_dispatcher.tp_ep_group, device))
        return self.overlap_session

    def _call_tag(self) -> int:
        """This call's tag (`gemm2_gather_rs(call_tag=...)`): the layer's number and its
        count of fused calls, alike on every rank of the group (they call the layers in
        one order), so that a rank that skipped a call raises with its peers instead of
        pairing its next call with their skipped one."""
        tag = ((self.layer_number or 0) % 128) << 8 | self._fused_calls % 256
        self._fused_calls += 1
        return tag

    def combine(self, output):
        """Stock reduce-scatter, unless routed_experts_compute already combined."""
        flight = self._in_flight
        if flight is not None and flight.path is not None and flight.path.fused:
            return output
        return super().combine(output)

    def _note_decision(self, plan, permuted: Permuted, weight) -> None:
        """INFO line on this layer's first launch and whenever (C, L) changes."""
        self.last_plan = plan
        self.last_rows = permuted.counts  # this rank's experts' (host or device) counts
        key = ("reference",) if plan is None else (plan.comm_ctas, plan.splits)
        if key == self._last_key:
            return
        self._last_key = key
        self.decisions += 1
        if log.isEnabledFor(logging.INFO):
            log.info("%s", launch_line(self.layer_number, plan, permuted, weight))
