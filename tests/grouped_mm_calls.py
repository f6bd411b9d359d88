"""Test helper: count the calls to ``torch._grouped_mm`` (the MoE grouped-matmul path)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def count_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> list[torch.Size]:
    """Wrap ``torch._grouped_mm`` for the test; returns the list its calls append their first
    argument's shape to."""
    calls: list[torch.Size] = []
    real = torch._grouped_mm

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls
