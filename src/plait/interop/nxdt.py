"""Importing a neuronx-distributed-training (NxDT) YAML config as a plait recipe.

Users coming from NxDT have configs with ``trainer``, ``exp_manager``, ``distributed_strategy``,
``data``, ``model`` (with ``optim``) and ``precision`` sections. :func:`import_nxdt` turns one
into plait recipe data and an account of every key: mapped (to which field, with what value),
ignored (why it does not matter to plait) or not mapped (why plait cannot express it).

NxDT's own checks are not plait's: the recipe is then checked with plait's validation for its
world size (tp*pp*dp), and a mapped value plait refuses (a kv_size_multiplier plait cannot
place, a pipeline schedule that needs more micro-batches, ...) is withdrawn, left to plait's
default, and reported as not mapped with plait's reason. The written recipe therefore passes
``plait config validate --nproc N --no-path-checks``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config.load import dump_recipe_text, parse_yaml
from plait.config.problems import RecipeError, format_value
from plait.config.validate import validate_recipe
from plait.interop.nxdt_collect import Collector, Entry
from plait.interop.nxdt_model import import_model
from plait.interop.nxdt_numerics import import_optim, import_precision
from plait.interop.nxdt_sections import (
    import_data,
    import_exp_manager,
    import_strategy,
    import_top,
    import_trainer,
)

#: sections only an NxDT (or NeMo/Lightning) config has; a plait recipe has none of them
NXDT_SECTIONS = ("trainer", "exp_manager", "distributed_strategy")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
#: a problem on a field the import left at plait's default (or already withdrew) is settled by
#: withdrawing a mapped value that constrains it (an interleaved schedule with too few
#: micro-batches: the vpp; fewer layers than pipeline stages: the vpp, then the pp)
_CONSTRAINED_BY = {"parallel.microbatches": ("parallel.vpp",), "parallel.schedule": ("parallel.vpp",),
                   "model.num_hidden_layers": ("parallel.vpp", "parallel.pp")}
#: how many times a plait refusal may withdraw mapped values before the rest is reported as is
_SETTLE_ROUNDS = 8


class NxdtConfigError(ValueError):
    """The file is not an NxDT config this importer can read (one line, naming the file)."""


@dataclass
class NxdtImport:
    """The result of an import: plait recipe data, the entry of every NxDT key, and the check."""

    source: str
    recipe: dict[str, dict[str, Any]]
    entries: list[Entry]
    world_size: int
    problems: list[str] = field(default_factory=list)

    def recipe_text(self) -> str:
        """The recipe as YAML 1.2 (plait's writer), with a comment naming its source."""
        header = (f"# imported from the NxDT config {self.source} by plait import-nxdt\n"
                  f"# check: plait config validate RECIPE --nproc {self.world_size} --no-path-checks\n")
        return header + (dump_recipe_text(self.recipe) if self.recipe else "{}\n")

    def of_kind(self, kind: str) -> list[Entry]:
        return [e for e in self.entries if e.kind == kind]

    def report(self) -> str:
        """Every key, grouped: mapped (nxdt key -> plait field = value), ignored and not mapped, with reasons."""
        lines = []
        for kind, title in (("mapped", "mapped"), ("ignored", "ignored"), ("not mapped", "not mapped")):
            entries = self.of_kind(kind)
            lines.append(f"{title} ({len(entries)}):")
            for e in entries:
                lines.append("  " + _entry_line(e))
        check = f"plait config validate --nproc {self.world_size} --no-path-checks"
        if self.problems:
            lines.append(f"{check}: {len(self.problems)} problem(s) remain; fix them in the recipe:")
            lines.extend(f"  {p}" for p in self.problems)
        else:
            lines.append(f"{check}: ok")
        return "\n".join(lines) + "\n"


def _entry_line(e: Entry) -> str:
    if e.kind == "mapped":
        targets = ", ".join(f"{name} = {format_value(value)}" for name, value in e.fields.items())
        return f"{e.key} -> {targets}" + (f"  ({e.reason})" if e.reason else "")
    shown = "" if e.value is None and e.key.startswith("(") else f" = {format_value(e.value)}"
    return f"{e.key}{shown}: {e.reason}"


# ---------------------------------------------------------------------- reading
def read_nxdt(path: str | Path) -> dict[str, Any]:
    """The data of an NxDT YAML file; :class:`NxdtConfigError` (one line, naming the file) otherwise."""
    p = Path(path)
    if not p.is_file():
        raise NxdtConfigError(f"{path}: {'no such file' if not p.exists() else 'not a file'}")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise NxdtConfigError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    try:
        data = parse_yaml(text, str(path))
    except RecipeError as e:
        raise NxdtConfigError(" ".join(str(e).split())) from None
    if not isinstance(data, Mapping):
        raise NxdtConfigError(f"{path}: not a YAML mapping; an NxDT config is a mapping with "
                              f"{', '.join(NXDT_SECTIONS)} sections")
    if not any(isinstance(data.get(s), Mapping) for s in NXDT_SECTIONS):
        hint = (" (it looks like a plait recipe already)" if "parallel" in data or "train" in data else "")
        raise NxdtConfigError(f"{path}: not an NxDT config: none of the sections {', '.join(NXDT_SECTIONS)}"
                              f"{hint}")
    return dict(data)


def resolve_references(data: Any, root: Mapping[str, Any]) -> Any:
    """``data`` with every value that is exactly ``${a.b}`` (an OmegaConf reference to a plain value)
    replaced by the value at ``a.b``; other references (resolvers such as ``${oc.env:X}``, text
    around a reference, a missing key, a reference to a section or list, a cycle) stay as written
    and are reported by whichever handler meets them."""
    if isinstance(data, Mapping):
        return {k: resolve_references(v, root) for k, v in data.items()}
    if isinstance(data, list):
        return [resolve_references(v, root) for v in data]
    return _resolve_scalar(data, root) if isinstance(data, str) else data


def _resolve_scalar(text: str, root: Mapping[str, Any]) -> Any:
    value: Any = text
    for _ in range(16):  # a chain of references, cut off (as text) if it is a cycle
        match = _REFERENCE.fullmatch(value.strip()) if isinstance(value, str) else None
        if match is None:
            return value
        node: Any = root
        for part in match.group(1).split("."):
            if not isinstance(node, Mapping) or part not in node:
                return text
            node = node[part]
        if isinstance(node, (Mapping, list)):
            return text
        value = node
    return text


# ---------------------------------------------------------------------- importing
def import_nxdt(data: Mapping[str, Any], base_dir: str | Path = ".", source: str = "<nxdt>") -> NxdtImport:
    """Plait recipe data and the account of every key of the NxDT config ``data``.

    ``base_dir`` is where a relative ``model.model_config`` path is looked up (the config's folder).
    """
    c = Collector(resolve_references(data, data))
    import_top(c)
    world = import_trainer(c)
    import_exp_manager(c)
    dp = import_strategy(c, world)
    import_data(c, dp)
    import_model(c, Path(base_dir))
    import_optim(c)
    import_precision(c)
    c.finish()
    problems = _settle(c)
    return NxdtImport(source, c.recipe(), c.entries, _world(c), problems)


def _world(c: Collector) -> int:
    sizes = [c.value(f"parallel.{k}", 1) for k in ("tp", "pp", "dp")]
    sizes = [s if isinstance(s, int) and not isinstance(s, bool) and s >= 1 else 1 for s in sizes]
    return sizes[0] * sizes[1] * sizes[2]


def _settle(c: Collector) -> list[str]:
    """Check the recipe with plait's validation; withdraw each mapped value plait refuses (reporting
    plait's reason) until it passes. Returns the problems no withdrawal could fix."""
    for _ in range(_SETTLE_ROUNDS):
        try:
            validate_recipe(c.recipe(), _world(c), check_paths=False)
            return []
        except RecipeError as e:
            problems = e.problems
        withdrawn = False
        for problem in problems:
            name = ".".join(problem.field.split(".")[:2])  # model.rope_scaling.x -> its field
            entry = c.owner(name) or next(filter(None, map(c.owner, _CONSTRAINED_BY.get(name, ()))), None)
            if entry is not None and entry.kind == "mapped":
                c.drop(entry, f"invalid for plait, left to plait's default: {problem}")
                withdrawn = True
        if not withdrawn:
            return [str(p) for p in problems]
    try:
        validate_recipe(c.recipe(), _world(c), check_paths=False)
        return []
    except RecipeError as e:
        return [str(p) for p in e.problems]
