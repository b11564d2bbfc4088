"""Optional dependencies: whether they import here, and why not (no import at load time)."""

from __future__ import annotations


def te_available() -> str | None:
    """None where Transformer Engine's PyTorch modules import, else why not (the
    `pip install megatron-overlap[te]` extra brings them)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or TE's own "Could not find ... torch lib"
        return f"{type(err).__name__}: {err}"
    return None
