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
