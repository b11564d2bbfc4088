"""Named bundles of kernel, device and calibration (stdlib only).

`a100-paper` reproduces the paper's A100 instantiation exactly. Hopper presets are
written by `tools/calibrate.py` as JSON files (one per device and kernel family, never
per shape) and shipped in `calibrations/`; they are found by name or by device name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .fusion import StepCosts
from .calibration import Calibration, Fp8Family
from .inputs import DeviceSpec, KernelSpec

CALIBRATION_DIR = Path(__file__).with_name("calibrations")
#: the most splits the op runs (its readiness flags: one word per split)
MAX_SPLITS = 64
#: the scaling kinds of GEMM2's FP8 operands a preset may calibrate (ops/fp8.py)
FP8_KINDS = ("tensor", "block")


@dataclass(frozen=True)
class Preset:
    name: str
    kernel: KernelSpec
    device: DeviceSpec
    calibration: Calibration
    default_splits: int = 1
    # The device's absolute time scales (planner/fusion.py): with them the MoE layer asks
    # the model whether to fuse each call; None (the paper's preset, a device without
    # them): it fuses at every size.
    step_costs: StepCosts | None = None
    # The FP8 kernel families' calibrations by scaling kind (`tools/calibrate.py --fp8`);
    # a kind without one is planned with the bf16 family's (`for_operands`).
    fp8: dict[str, Fp8Family] = field(default_factory=dict, hash=False)

    def for_operands(self, fp8: str | None) -> tuple[Calibration, StepCosts | None]:
        """The calibration and step costs that plan a GEMM2 on operands of scaling kind
        `fp8` (None: bf16): the kind's own where calibrated, else the bf16 family's."""
        family = self.fp8.get(fp8) if fp8 is not None else None
        if family is None:
            return self.calibration, self.step_costs
        costs = self.step_costs
        if costs is not None and family.wave_us is not None:
            costs = replace(costs, wave_us=family.wave_us)
        return family.calibration, costs

    def with_sm_margin(self, sm_margin: int) -> "Preset":
        return replace(self, device=DeviceSpec(self.device.name, self.device.sms, sm_margin))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kernel": asdict(self.kernel),
            "device": {"name": self.device.name, "sms": self.device.sms},
            "calibration": asdict(self.calibration),
            "default_splits": self.default_splits,
            **({"step_costs": asdict(self.step_costs)} if self.step_costs is not None else {}),
            **({"fp8": {kind: asdict(f) for kind, f in sorted(self.fp8.items())}}
               if self.fp8 else {}),
        }

    def __post_init__(self) -> None:
        d = self.default_splits
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_SPLITS:
            raise ValueError(f"Preset.default_splits must be an int in [1, {MAX_SPLITS}], "
                             f"got {d!r}")
        if self.step_costs is not None and not isinstance(self.step_costs, StepCosts):
            raise ValueError(f"Preset.step_costs must be a StepCosts or None, got "
                             f"{type(self.step_costs).__name__}")
        if not isinstance(self.fp8, dict):
            raise ValueError(f"Preset.fp8 must be a dict, got {type(self.fp8).__name__}")
        for kind, family in self.fp8.items():
            if kind not in FP8_KINDS or not isinstance(family, Fp8Family):
                raise ValueError(f"Preset.fp8 maps a scaling kind in {FP8_KINDS} to an "
                                 f"Fp8Family, got {kind!r}: {type(family).__name__}")

    @classmethod
    def from_json(cls, data: dict) -> "Preset":
        try:
            return cls(
                name=data["name"],
                kernel=KernelSpec(**data["kernel"]),
                device=DeviceSpec(data["device"]["name"], data["device"]["sms"]),
                calibration=Calibration(**data["calibration"]),
                default_splits=data.get("default_splits", 1),
                step_costs=(StepCosts(**data["step_costs"]) if data.get("step_costs")
                            is not None else None),
                fp8={kind: Fp8Family(Calibration(**f["calibration"]), f.get("wave_us"))
                     for kind, f in data.get("fp8", {}).items()},
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed calibration preset: {type(err).__name__}: {err}") from err


A100_PAPER = Preset(
    name="a100-paper",
    kernel=KernelSpec(tile_m=128, tile_n=128, comm_tile_m=128, comm_tile_n=1024,
                      o_comp=2, o_comm=1),
    device=DeviceSpec("NVIDIA A100-SXM4-40GB", sms=108),
    calibration=Calibration(rho_ref=10.05, k_ref=352, tm_ref=128, tn_ref=128, d_ref=4,
                            c_max=16),
    default_splits=2,
)


def load_preset_file(path: str | Path) -> Preset:
    """A preset from a calibration JSON file (the format `tools/calibrate.py` writes);
    any problem with the file is a ValueError that names it."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"the top level is a JSON {type(data).__name__}, not an object")
        preset = data.get("preset", data)
        if not isinstance(preset, dict):
            raise ValueError(f"'preset' is a JSON {type(preset).__name__}, not an object")
        return Preset.from_json(preset)
    except (OSError, ValueError) as err:  # (json.JSONDecodeError is a ValueError)
        raise ValueError(f"calibration file {str(path)!r}: {err}") from err


def _shipped() -> dict[str, Preset]:
    found = {A100_PAPER.name: A100_PAPER}
    for path in sorted(CALIBRATION_DIR.glob("*.json")):
        preset = load_preset_file(path)
        found[preset.name] = preset
    return found


def preset_names() -> list[str]:
    return sorted(_shipped())


def get_preset(name: str) -> Preset:
    """A preset by name (`a100-paper` or a shipped calibration), or a JSON file path."""
    if name.endswith(".json") or "/" in name:
        return load_preset_file(name)
    presets = _shipped()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(presets))}")
    return presets[name]


def preset_for_device(device_name: str) -> Preset | None:
    """The shipped calibration whose device name matches, if any."""
    for preset in _shipped().values():
        if preset.name != A100_PAPER.name and preset.device.name == device_name:
            return preset
    return None
