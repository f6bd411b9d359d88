"""Whether the forward running now is an activation-checkpointing recomputation.

A checkpointed module's forward runs twice: once in the forward pass and again inside the
backward. Layers that count or communicate in their forward (MoE load statistics, the global
load-balancing share) must do so once; this tells the second run from the first without any
hook into the checkpointing wrapper.
"""

from __future__ import annotations

import torch


def recomputing() -> bool:
    """Whether the forward running now runs inside a backward pass (the autograd engine has a
    current graph task), as a checkpointed forward's recomputation does."""
    return torch._C._current_graph_task_id() != -1
