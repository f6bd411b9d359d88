"""Non-persistent buffers after materialisation."""

from __future__ import annotations

from torch import nn


def reset_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary tables, head masks) after ``to_empty``: every
    submodule that holds one defines ``reset_buffers()``."""
    for m in model.modules():
        reset = getattr(m, "reset_buffers", None)
        if m is not model and reset is not None:
            reset()
