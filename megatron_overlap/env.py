"""Environment variables of the operator, read when a value is needed (never at import,
so a bad value cannot break `import megatron_overlap`) and checked: a bad value raises
ValueError naming the variable instead of turning into a surprising setting."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


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


def env_int(name: str, default: int, lo: int, hi: int) -> int:
    """An integer variable in [lo, hi]; unset or empty = `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise ValueError(f"environment variable {name}={os.environ[name]!r} must be an "
                         f"integer in [{lo}, {hi}]")
    return value


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
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not 0 < value <= hi:  # (NaN fails the comparison)
        raise ValueError(f"environment variable {name}={os.environ[name]!r} must be a "
                         f"number in (0, {hi:g}]")
    return value
