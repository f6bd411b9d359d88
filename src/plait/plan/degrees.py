"""The parallel degrees of a run as the planner sees them, with the memory-relevant switches."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ParallelDegrees:
    """One candidate way to run a model on ``world = tp * pp * dp * cp`` devices (``ep`` folds over
    ``dp``: it divides it and adds no devices)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    kv_replication: int = 1
    sequence_parallel: bool = False
    zero: int = 0                           # ZeRO level 0-3 over the dp x cp ranks
    activation_checkpointing: str = "none"  # "none" | "full" | "selective"
    schedule: str = "1f1b"                  # "gpipe" | "1f1b" | "interleaved-1f1b"
    cp: int = 1                             # context parallelism: each sequence split over cp ranks
    ep: int = 1                             # expert parallelism (MoE): experts split over ep of the dp ranks
    offload: bool = False                   # the fp32 master and AdamW moments in host memory

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.kv_replication > 1:
            parts.append(f"kv{self.kv_replication}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.offload:
            parts.append("offload")
        if self.activation_checkpointing != "none":
            parts.append(f"ckpt-{self.activation_checkpointing}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)
