"""Named bundles of kernel, device and calibration (stdlib only).

`a100-paper` reproduces the paper's A100 instantiation exactly. Hopper presets are
written by `tools/calibrate.py` as JSON files (one per device and kernel family, never
per shape) and shipped in `calibrations/`; they are found by name or by device name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .model import Calibration, DeviceSpec, KernelSpec

CALIBRATION_DIR = Path(__file__).with_name("calibrations")
#: the most splits the op runs (its readiness flags: one word per split)
MAX_SPLITS = 64


@dataclass(frozen=True)
class Preset:
    name: str
    kernel: KernelSpec
    device: DeviceSpec
    calibration: Calibration
    default_splits: int = 1
    # Below this many elements of a layer's combined output (tokens x hidden), a Megatron
    # MoE layer runs its stock path: measured per device (docs/RESULTS.md), 0 = never.
    min_combine_elements: int = 0
    # The same where the group is one rank (one GPU: no reduce-scatter, a shorter host
    # path), where it was measured on its own; None = min_combine_elements.
    min_combine_elements_one_rank: int | None = None
    # Below this many multiply-adds of one rank's expert down-projection (GEMM2: M x top-k
    # x hidden x FFN x local / all experts, uniform routing) the layer runs its stock path
    # too: a proxy for how much GPU work a layer has to hide the overlap's host work behind,
    # 0 = never; `_one_rank` as above.
    min_gemm2_macs: int = 0
    min_gemm2_macs_one_rank: int | None = None

    def combine_threshold(self, world: int) -> int:
        """min_combine_elements for a group of `world` ranks."""
        return self._for_group("min_combine_elements", world)

    def gemm2_threshold(self, world: int) -> int:
        """min_gemm2_macs for a group of `world` ranks."""
        return self._for_group("min_gemm2_macs", world)

    def _for_group(self, name: str, world: int) -> int:
        one_rank = getattr(self, name + "_one_rank")
        return one_rank if world == 1 and one_rank is not None else getattr(self, name)

    def thresholds(self) -> dict:
        """The four stock-path threshold fields by name (measured by prefill sweeps, not by
        `tools/calibrate.py`, which carries them over from the shipped preset)."""
        return {name: getattr(self, name) for name in _THRESHOLDS}

    def with_sm_margin(self, sm_margin: int) -> "Preset":
        return replace(self, device=DeviceSpec(self.device.name, self.device.sms, sm_margin))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kernel": asdict(self.kernel),
            "device": {"name": self.device.name, "sms": self.device.sms},
            "calibration": asdict(self.calibration),
            "default_splits": self.default_splits,
            **{name: m for name, m in self.thresholds().items() if m is not None},
        }

    def __post_init__(self) -> None:
        d = self.default_splits
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_SPLITS:
            raise ValueError(f"Preset.default_splits must be an int in [1, {MAX_SPLITS}], "
                             f"got {d!r}")
        for name in _THRESHOLDS:
            m = getattr(self, name)
            if m is None and name.endswith("one_rank"):
                continue
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise ValueError(f"Preset.{name} must be an int >= 0, got {m!r}")

    @classmethod
    def from_json(cls, data: dict) -> "Preset":
        try:
            return cls(
                name=data["name"],
                kernel=KernelSpec(**data["kernel"]),
                device=DeviceSpec(data["device"]["name"], data["device"]["sms"]),
                calibration=Calibration(**data["calibration"]),
                default_splits=data.get("default_splits", 1),
                # (absent from files written before a field: never / the group's value)
                **{name: data.get(name, None if name.endswith("_one_rank") else 0)
                   for name in _THRESHOLDS},
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed calibration preset: {type(err).__name__}: {err}") from err


_THRESHOLDS = ("min_combine_elements", "min_combine_elements_one_rank", "min_gemm2_macs",
               "min_gemm2_macs_one_rank")

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
