"""The last collective this process entered on each process group, and how many it entered.

Read by the stall watchdog (:mod:`plait.train.watchdog`) when a collective hangs: ranks of one
group that entered different numbers of collectives on it show which rank fell behind, and the
name says which call it is stuck in (NCCL's flight recorder keeps the same sequence numbers on
CUDA; this works on every backend). Recording is a dictionary update per call: no host
synchronisation, no allocation on the device.

This is the one piece of per-process state in :mod:`plait.comm`; it holds diagnostics only,
never anything a computation reads.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_entered: dict[int, tuple[dist.ProcessGroup | None, str, int]] = {}  # id(group) -> (group, operation, count)


def entered(operation: str, group: dist.ProcessGroup | None) -> None:
    """Note that this process enters ``operation`` on ``group`` (called by the primitives)."""
    key = id(group)
    previous = _entered.get(key)
    _entered[key] = (group, operation, 1 if previous is None else previous[2] + 1)


def last_entered() -> dict[str, dict[str, Any]]:
    """``{"ranks [0, 1]": {"operation": "all_reduce", "count": 1234}, ...}`` for every group used."""
    items = list(_entered.values())  # one C-level copy: safe against the training thread's updates
    out = {}
    for group, operation, count in items:
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
            name = f"ranks {sorted(ranks)}"
        except (RuntimeError, ValueError, AttributeError):
            name = f"group {id(group):#x}"
        out[name] = {"operation": operation, "count": count}
    return out
