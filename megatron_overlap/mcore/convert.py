"""`overlap_moe_layers(model, ...)`: every MoE layer of an already-built model overlapped.

The spec helpers (`with_overlap_moe`) install OverlapMoELayer before a model is built;
this applies it to a model some other builder made (gpt-fast's way: parallelism applied
to a built model by one function): Megatron-LM's GPTModel from Megatron's own spec choice
or a user's `--spec`, its multi-token-prediction block, HybridModel, a model a framework
returns. Each exact `megatron.core` MoELayer becomes an OverlapMoELayer in place
(`OverlapMoELayer.adopt`: same module, parameters, process groups and dispatcher object),
so the model's weights, initialization and state-dict keys are those of the stock build.
Call it before an optimizer or DDP holds the parameters (the adopted experts' FC2 weights
are packed back to back, values unchanged: `fc2_operands.pack_expert_weights`).

What cannot fuse is known here, at build, not at the first forward: the report names
every layer that will run the stock path and why (`OverlapMoELayer.unsupported_reason`),
and `strict=True` turns any such layer into an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..ops import OverlapConfig
from .layer import OverlapMoELayer, checked_overlap_args
from .policy import LayerPolicy


@dataclass(frozen=True)
class StockLayer:
    """A MoE layer that runs Megatron's stock path at every size, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class OverlapReport:
    """What `overlap_moe_layers` made of one model.

    overlapped: the module names of the layers that run the fused op (where the planner
        predicts it faster, or always with `LayerPolicy.fuse = "always"`).
    stock: the MoE layers left on the stock path at every size, with the reason.
    experts / dispatchers: the experts' and dispatchers' class names of the overlapped
        layers (distinct, in order of appearance).
    """

    overlapped: tuple[str, ...]
    stock: tuple[StockLayer, ...]
    experts: tuple[str, ...]
    dispatchers: tuple[str, ...]

    @property
    def moe_layers(self) -> int:
        return len(self.overlapped) + len(self.stock)

    def summary(self) -> str:
        """One line: how many MoE layers are overlapped, with what, and each stock one."""
        line = (f"megatron-overlap: {len(self.overlapped)} of {self.moe_layers} MoE layers "
                "overlapped")
        if self.overlapped:
            line += f" ({', '.join(self.experts)} experts, {', '.join(self.dispatchers)})"
        by_reason: dict[str, list[str]] = {}
        for layer in self.stock:
            by_reason.setdefault(layer.reason, []).append(layer.name)
        if by_reason:
            line += "; stock: " + "; ".join(f"{', '.join(names)} ({reason})"
                                            for reason, names in by_reason.items())
        return line


class OverlapBuildError(ValueError):
    """`strict=True` and some MoE layer cannot run the fused op (the message names each)."""


def _why_not_adoptable(layer) -> str | None:
    if isinstance(layer, OverlapMoELayer) or type(layer) is MoELayer:
        return None
    return (f"the custom MoE class {type(layer).__qualname__} (only megatron.core MoELayer "
            "is overlapped)")


def overlap_moe_layers(model, overlap_config: OverlapConfig | None = None,
                       policy: LayerPolicy | None = None, *,
                       strict: bool = False) -> OverlapReport:
    """Make every MoE layer of `model` (a module, or a list of pipeline-stage modules) an
    OverlapMoELayer with `overlap_config` and `policy` (None: the defaults), in place;
    layers that already are one get the new config, never a second wrap.

    Returns the OverlapReport (`.summary()` is the line a launcher prints). With
    `strict`, any MoE layer left stock raises OverlapBuildError naming each, after the
    others were adopted.
    """
    checked_overlap_args(overlap_config, policy)
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ValueError("model must be a torch.nn.Module or a non-empty list of them (one "
                         f"per pipeline stage), got {type(model).__name__}")
    overlapped, stock, experts, dispatchers = [], [], [], []
    for index, module in enumerate(modules):
        prefix = f"model[{index}]." if len(modules) > 1 else ""
        for name, layer in module.named_modules():
            if not isinstance(layer, MoELayer):
                continue
            name = prefix + name
            why = _why_not_adoptable(layer)
            if why is None:
                layer = OverlapMoELayer.adopt(layer, overlap_config, policy)
                why = layer.unsupported_reason
            if why is not None:
                stock.append(StockLayer(name, why))
                continue
            overlapped.append(name)
            for found, obj in ((experts, layer.experts), (dispatchers, layer.token_dispatcher)):
                if type(obj).__name__ not in found:
                    found.append(type(obj).__name__)
    report = OverlapReport(tuple(overlapped), tuple(stock), tuple(experts), tuple(dispatchers))
    if strict and stock:
        raise OverlapBuildError(
            f"--moe-overlap-strict: {len(stock)} of {report.moe_layers} MoE layers cannot be "
            "overlapped: " + "; ".join(f"{s.name}: {s.reason}" for s in stock))
    return report


# ---------------------------------------------------------------- a built model's layers
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
    enabled = [(layer.overlap_enabled, layer.policy) for layer in layers]
    for layer in layers:
        layer.overlap_enabled = True
        layer.policy = dataclasses.replace(layer.policy, fuse="always")
    try:
        yield
    finally:
        for layer, (on, policy) in zip(layers, enabled):
            layer.overlap_enabled, layer.policy = on, policy
