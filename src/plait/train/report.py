"""Turn a run's ``metrics.jsonl`` into a plot and a plain-text summary.

Records are the JSON objects written by :class:`plait.train.loggers.JsonlSink`. Training
records carry ``loss`` (and usually ``tokens_per_s``, ``mfu``, ``peak_memory_bytes`` or
``peak_memory_gb``, ``data_wait_s`` + ``step_time_s`` or ``data_wait_share``, ``elapsed_s``);
validation records carry ``val_loss`` (possibly in the same record). Missing metrics show as
``n/a``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PathLike = str | os.PathLike


def read_metrics(metrics_jsonl: PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file (blank and truncated last lines are skipped)."""
    path = Path(metrics_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if _is_number(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def plot_run(metrics_jsonl: PathLike, out_png: PathLike, *, title: str | None = None) -> Path:
    """Write a PNG: training / validation loss vs step, tokens/s vs step and, for a preference run,
    a middle panel with the reward accuracy (left axis) and reward margin (right axis), train and
    validation; for a GRPO run, a middle panel with the rollouts' reward mean and accuracy and the
    held-out exact match."""
    # lazy: matplotlib takes about half a second to import and only this plot (logging.plot) needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    records = read_metrics(metrics_jsonl)
    preference = any("rewards/accuracy" in r or "val_rewards/accuracy" in r for r in records)
    rollouts = any("reward/mean" in r for r in records)
    middle = preference or rollouts
    fig = Figure(figsize=(8, 9.0 if middle else 6.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3 if middle else 2, 1, sharex=True)
    ax_loss, ax_tps = axes[0], axes[-1]
    if preference:
        _plot_rewards(axes[1], records)
    elif rollouts:
        _plot_rollout_rewards(axes[1], records)

    steps, loss = _series(records, "loss")
    if steps:
        ax_loss.plot(steps, loss, label="train loss", linewidth=1.0)
    vsteps, vloss = _series(records, "val_loss")
    if vsteps:
        ax_loss.plot(vsteps, vloss, "o-", label="val loss", markersize=3)
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    if steps or vsteps:
        ax_loss.legend()

    tsteps, tps = _series(records, "tokens_per_s")
    if tsteps:
        ax_tps.plot(tsteps, tps, color="tab:green", linewidth=1.0)
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)

    fig.suptitle(title or Path(metrics_jsonl).parent.name or "run")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _plot_rollout_rewards(ax: Axes, records: list[dict[str, Any]]) -> None:
    """A GRPO run's rollouts: reward mean and exact-match accuracy per interval, held-out exact match."""
    for key, style, label in (("reward/mean", "-", "rollout reward (mean)"), ("accuracy", "--", "rollout accuracy"),
                              ("val_exact_match", "o-", "held-out exact match")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1.0)
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize="small")


def _plot_rewards(ax: Axes, records: list[dict[str, Any]]) -> None:
    """Reward accuracy (left axis, 0-1) and reward margin (right axis) of a preference run."""
    margin_ax = ax.twinx()
    for key, axis, style, label in (("rewards/accuracy", ax, "-", "train accuracy"),
                                    ("val_rewards/accuracy", ax, "o-", "val accuracy"),
                                    ("rewards/margin", margin_ax, "--", "train margin"),
                                    ("val_rewards/margin", margin_ax, "s--", "val margin")):
        xs, ys = _series(records, key)
        if xs:
            axis.plot(xs, ys, style, label=label, markersize=3, linewidth=1.0,
                      color="tab:blue" if axis is ax else "tab:orange")
    ax.set_ylabel("reward accuracy")
    ax.set_ylim(-0.02, 1.02)
    margin_ax.set_ylabel("reward margin")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + margin_ax.get_legend_handles_labels()[0]
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize="small")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _human_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _ppl(loss: float) -> str:
    return f"{math.exp(loss):.2f}" if loss < 700 else "inf"


def _wall_time(records: list[dict[str, Any]], start_step: int = 0) -> float | None:
    """``elapsed_s`` / ``wall_seconds`` if logged; else the span of the ``time`` stamps, extended
    back to ``start_step`` at the average seconds per step (the first record is written after its steps)."""
    for key in ("elapsed_s", "wall_seconds"):
        _, values = _series(records, key)
        if values:
            return max(values)
    steps, times = _series(records, "time")
    if len(times) >= 2 and steps[-1] > steps[0]:
        span = times[-1] - times[0]
        return span + (steps[0] - start_step) * span / (steps[-1] - steps[0])
    _, step_times = _series(records, "step_time_s")
    return sum(step_times) if step_times else None


def _data_wait_share(records: list[dict[str, Any]]) -> float | None:
    """``sum(data_wait_s) / sum(step_time_s)``, else the mean of logged ``data_wait_share`` values."""
    paired = [(r["data_wait_s"], r["step_time_s"]) for r in records
              if _is_number(r.get("data_wait_s")) and _is_number(r.get("step_time_s"))]
    total = sum(t for _, t in paired)
    if paired and total > 0:
        return sum(w for w, _ in paired) / total
    _, shares = _series(records, "data_wait_share")
    return statistics.fmean(shares) if shares else None


def _peak_memory(records: list[dict[str, Any]]) -> float | None:
    _, mem = _series(records, "peak_memory_bytes")
    if mem:
        return max(mem)
    _, mem_gb = _series(records, "peak_memory_gb")
    return max(mem_gb) * 1e9 if mem_gb else None


def summarize(metrics_jsonl: PathLike, start_step: int = 0) -> dict[str, Any]:
    """The numbers behind :func:`summary_table` (``None`` where the run did not log them).

    ``start_step``: the step this run started (resumed) from. The loss curve covers every record
    of the file; throughput, MFU, memory, data-wait share and wall time cover this run's steps
    only (records after ``start_step``), and ``steps_trained`` counts them.
    """
    records = read_metrics(metrics_jsonl)
    this_run = [r for r in records if int(r["step"]) > start_step]
    steps, loss = _series(records, "loss")
    vsteps, vloss = _series(records, "val_loss")
    _, tps = _series(this_run, "tokens_per_s")
    _, mfus = _series(this_run, "mfu")
    best = min(range(len(loss)), key=loss.__getitem__) if loss else None
    vbest = min(range(len(vloss)), key=vloss.__getitem__) if vloss else None
    final_step = max((int(r["step"]) for r in records), default=None)
    return {
        "steps": final_step,
        "final_step": final_step,
        "start_step": start_step,
        "steps_trained": None if final_step is None else max(final_step - start_step, 0),
        "final_loss": loss[-1] if loss else None,
        "best_loss": loss[best] if best is not None else None,
        "best_loss_step": steps[best] if best is not None else None,
        "final_val_loss": vloss[-1] if vloss else None,
        "best_val_loss": vloss[vbest] if vbest is not None else None,
        "best_val_loss_step": vsteps[vbest] if vbest is not None else None,
        "median_tokens_per_s": statistics.median(tps) if tps else None,
        "median_mfu": statistics.median(mfus) if mfus else None,
        "peak_memory_bytes": _peak_memory(this_run),
        "data_wait_share": _data_wait_share(this_run),
        "wall_time_s": _wall_time(this_run, start_step),
        "compile_s": max((float(r["compile_s"]) for r in this_run if "compile_s" in r), default=None),
    }


def _steps_trained(s: dict[str, Any]) -> str:
    if s["steps_trained"] is None:
        return "n/a"
    return f"{s['steps_trained']}" + (f" (resumed at step {s['start_step']})" if s["start_step"] else "")


#: (label, metric) of a preference run's last logged values, shown when the run logged them
PREFERENCE_ROWS = (("reward accuracy", "rewards/accuracy"), ("reward margin", "rewards/margin"),
                   ("val reward accuracy", "val_rewards/accuracy"), ("val reward margin", "val_rewards/margin"))


def _preference_rows(metrics_jsonl: PathLike) -> list[tuple[str, str]]:
    """The last logged reward accuracy and margin (train and validation) of a preference run."""
    last: dict[str, float] = {}
    for record in read_metrics(metrics_jsonl):
        last.update({k: v for k, v in record.items() if isinstance(v, (int, float)) and k.startswith(
            ("rewards/", "val_rewards/"))})
    return [(label, f"{last[key]:.2%}" if "accuracy" in key else f"{last[key]:+.4f}")
            for label, key in PREFERENCE_ROWS if key in last]


def summary_table(metrics_jsonl: PathLike, start_step: int = 0) -> str:
    """A plain-text two-column table of a run's headline numbers (``start_step``: see :func:`summarize`)."""
    s = summarize(metrics_jsonl, start_step)
    na = "n/a"

    def loss_at(value: float | None, step: int | None) -> str:
        return na if value is None else f"{value:.4f}" + (f" (step {step})" if step is not None else "")

    def val(value: float | None, step: int | None) -> str:
        return na if value is None else f"{loss_at(value, step)}, ppl {_ppl(value)}"

    rows = [
        ("final step", na if s["final_step"] is None else str(s["final_step"])),
        ("steps trained", _steps_trained(s)),
        ("final loss", loss_at(s["final_loss"], None)),
        ("best loss", loss_at(s["best_loss"], s["best_loss_step"])),
        ("final val loss", val(s["final_val_loss"], None)),
        ("best val loss", val(s["best_val_loss"], s["best_val_loss_step"])),
        ("median tokens/s", na if s["median_tokens_per_s"] is None else f"{s['median_tokens_per_s']:,.0f}"),
        ("median MFU", na if s["median_mfu"] is None else f"{s['median_mfu']:.2%}"),
        ("peak memory", na if s["peak_memory_bytes"] is None else _human_bytes(s["peak_memory_bytes"])),
        ("data-wait share", na if s["data_wait_share"] is None else f"{s['data_wait_share']:.1%}"),
        ("wall time", na if s["wall_time_s"] is None else _human_seconds(s["wall_time_s"])),
    ]
    if s["compile_s"] is not None:  # train.compile: not part of tokens/s
        rows.append(("compile time", f"{s['compile_s']:.1f} s (slowest rank; not counted in tokens/s)"))
    rows += _preference_rows(metrics_jsonl)
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    body = [f"{'metric'.ljust(width)}  value", line] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(body)


__all__ = ["plot_run", "read_metrics", "summarize", "summary_table"]
