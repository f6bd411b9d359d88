"""Expert load over training: one line per log in ``moe_load.jsonl``, and its heat map.

Each logged step appends ``{"step": s, "layers": {"layer0": [share of expert 0, ...], ...}}``: the
share of the interval's routing assignments each expert received (1/E each under perfect
balance), averaged over the ranks holding the layer. At the end of the run
:func:`plot_load_map` draws one heat map per MoE layer (experts x logged steps) to a PNG, so a
collapsing router (a few experts taking everything) is visible at a glance.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the file in the run directory
MOE_LOAD_FILE = "moe_load.jsonl"


def append_load(path: Path, step: int, loads: dict[str, list[float]]) -> None:
    """Add one logged step's per-layer expert shares to ``path``."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "layers": loads}) + "\n")


def read_load(path: Path, last_step: int | None = None) -> list[dict]:
    """The records of ``path`` by step (a step written twice, by a resumed run, keeps its last line),
    up to ``last_step``."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step) if last_step is None or s <= last_step]


def plot_load_map(path: Path, out_png: Path, last_step: int | None = None) -> Path | None:
    """One heat map per layer (rows: experts, columns: logged steps, colour: share of the load);
    ``None`` when there is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only this plot needs it
    from matplotlib.figure import Figure

    records = read_load(path, last_step)
    layers = sorted({name for r in records for name in r["layers"]}, key=lambda n: int(n.removeprefix("layer")))
    if not records or not layers:
        return None
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(8, min(40.0, 1.0 + 1.6 * len(layers))), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(layers), 1, sharex=True, squeeze=False)[:, 0]
    image = None
    for ax, name in zip(axes, layers, strict=True):
        rows = [r["layers"].get(name) for r in records]
        experts = max(len(row) for row in rows if row)
        grid = [[(row[e] if row else float("nan")) for row in rows] for e in range(experts)]
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, experts - 0.5, -0.5))
        ax.set_ylabel(f"{name}\nexpert")
    axes[-1].set_xlabel("step")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="share of assignments")
    fig.suptitle(f"expert load ({Path(path).parent.name or 'run'})")
    out = Path(out_png)
    fig.savefig(out, format="png")
    return out
