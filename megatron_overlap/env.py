"""The environment variables of `OverlapConfig.from_env()`, the one place the package
reads its own (library code takes an OverlapConfig; tools and launchers that want the
environment call `from_env`). Read when `from_env` is called, never at import, so a bad
value cannot break `import megatron_overlap`, and checked: a bad value raises
ValueError naming the variable instead of turning into a surprising setting.

    MEGATRON_OVERLAP_TILES           a tune_tiles JSON (`tools/tune_tiles.py --json`):
                                     OverlapConfig.tiles (CUDA tiles), in the placement
                                     of MEGATRON_OVERLAP_PLACEMENT where that is set too
    MEGATRON_OVERLAP_PLACEMENT       shared | partition: OverlapConfig.placement
    MEGATRON_OVERLAP_TAIL_HELPERS    a boolean (0/1, false/true, no/yes, off/on):
                                     OverlapConfig.tail_helpers
    MEGATRON_OVERLAP_WAIT_TIMEOUT_S  seconds in (0, 2147.48] (the GPU timer's int32 us):
                                     OverlapConfig.wait_timeout_s
    MEGATRON_OVERLAP_MAX_SPINS       an int in [1, 2**31 - 1]: OverlapConfig.max_spins

Unset or empty leaves the field's default. Any other MEGATRON_OVERLAP_* variable set
draws a warning naming it (REMOVED says why the former ones are gone).
"""

from __future__ import annotations

import os
import warnings

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

PREFIX = "MEGATRON_OVERLAP_"
#: the variables `OverlapConfig.from_env` reads -> the OverlapConfig field each sets
VARIABLES = {
    "MEGATRON_OVERLAP_TILES": "tiles",
    "MEGATRON_OVERLAP_PLACEMENT": "placement",
    "MEGATRON_OVERLAP_TAIL_HELPERS": "tail_helpers",
    "MEGATRON_OVERLAP_WAIT_TIMEOUT_S": "wait_timeout_s",
    "MEGATRON_OVERLAP_MAX_SPINS": "max_spins",
}
#: variables earlier versions read deep in the op, and why none reads them now
REMOVED = {
    "MEGATRON_OVERLAP_FAST_LAUNCH": "cached-binary launches are the default and give "
                                    "Triton's own launches' bits; LaunchCache.fast in code",
    "MEGATRON_OVERLAP_MAPPED_OFFSETS": "host counts read in place are the default, with a "
                                       "copy fallback; ops.routing.Router.mapped_offsets in code",
    "MEGATRON_OVERLAP_DRIVER_EVENTS": "driver event calls are the default; "
                                      "StreamOps.driver in code",
    "MEGATRON_OVERLAP_INTERPRET_SMS": "the interpreter's virtual device has "
                                      "ops.config.INTERPRET_SMS SMs",
}


def env_bool(name: str, default: bool) -> bool:
    """A boolean variable: 0/1, false/true, no/yes, off/on (any case); unset or empty
    = `default`."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r} is not a boolean "
                     f"(use one of {', '.join(_FALSE + _TRUE)})")


def _number(name: str, default, convert, ok, what: str):
    """`convert` of the variable where `ok` accepts it; unset or empty = `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = convert(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):  # (NaN fails every comparison)
        raise ValueError(f"environment variable {name}={os.environ[name]!r} must be {what}")
    return value


def env_int(name: str, default: int, lo: int, hi: int) -> int:
    """An integer variable in [lo, hi]; unset or empty = `default`."""
    return _number(name, default, int, lambda v: lo <= v <= hi,
                   f"an integer in [{lo}, {hi}]")


def env_choice(name: str, choices: tuple) -> str | None:
    """One of `choices`, or None where unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in choices:
        raise ValueError(f"environment variable {name}={raw!r} must be one of {choices}")
    return raw


def env_float(name: str, default: float, hi: float) -> float:
    """A finite number in (0, hi]; unset or empty = `default`."""
    return _number(name, default, float, lambda v: 0 < v <= hi, f"a number in (0, {hi:g}]")


def env_parsed(name: str, parse):
    """`parse(value)` of a set variable, its ValueError naming the variable too."""
    raw = os.environ[name].strip()
    try:
        return parse(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={raw!r}: {err}") from err


def fields_from_env(readers: dict, overrides: dict) -> dict:
    """Keyword arguments for OverlapConfig: `readers[field](variable)` for each set
    variable of VARIABLES whose field `overrides` does not give, then `overrides`.
    Warns about any other MEGATRON_OVERLAP_* variable set (a removed or misspelt one
    would otherwise change nothing, silently)."""
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in VARIABLES and os.environ[name].strip():
            why = REMOVED.get(name, "not a setting of this version")
            warnings.warn(f"environment variable {name} is not read: {why}. "
                          f"OverlapConfig.from_env reads {', '.join(VARIABLES)}",
                          RuntimeWarning, stacklevel=3)
    fields = {field: readers[field](name) for name, field in VARIABLES.items()
              if field not in overrides and os.environ.get(name, "").strip()}
    fields.update(overrides)
    return fields


__all__ = ["PREFIX", "REMOVED", "VARIABLES", "env_bool", "env_choice", "env_float",
           "env_int", "env_parsed", "fields_from_env"]
