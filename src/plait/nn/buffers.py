"""Buffers whose value a module fixes itself, after materialisation."""

from __future__ import annotations

from torch import nn


def reset_buffers(model: nn.Module) -> None:
    """Recompute the buffers a module defines itself (rotary tables, head masks, a router's zero
    balancing bias) after ``to_empty``: every submodule that holds one defines ``reset_buffers()``;
    values loaded afterwards (a checkpoint's balancing bias) overwrite them."""
    for m in model.modules():
        reset = getattr(m, "reset_buffers", None)
        if m is not model and reset is not None:
            reset()
