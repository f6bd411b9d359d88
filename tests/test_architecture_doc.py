"""docs/architecture.md stays true: every file or folder it names exists, every ``build_run.<name>``
it sends a reader to is a function there, and every plug-in class its tables list is one."""

from __future__ import annotations

import re
from pathlib import Path

import plait.train.build_run as build_run
from plait.models.registry import FAMILIES
from plait.train import plugins
from plait.train.final_export import AdapterExport, FullModelExport
from plait.train.moe_statistics import MoeStatistics
from plait.train.objectives import NextTokenObjective, PreferenceObjective

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SRC = ROOT / "src" / "plait"

PATH = re.compile(r"`((?:[a-z_]+|<family>|<feature>|<objective>|<name>)(?:/[a-z_<>]*)*(?:\.py|/))`")


def named_paths(text: str) -> list[str]:
    return sorted(set(PATH.findall(text)))


def missing(paths: list[str]) -> list[str]:
    """Paths of ``paths`` that exist under none of src/plait, the repository root, tests/ or (a
    family's own file, as the family table names them) a family folder. ``<family>`` must exist
    for every family; ``<feature>``-like placeholders name new files, so only their folder must."""
    bases = (SRC, ROOT, ROOT / "src", ROOT / "tests", SRC / "models", SRC / "models" / "llama")
    absent = []
    for path in paths:
        if any(p in path for p in ("<feature>", "<objective>", "<name>")):
            path = path.rsplit("/", 1)[0] + "/"
        for candidate in ([path.replace("<family>", name) for name in FAMILIES] if "<family>" in path else [path]):
            if not any((base / candidate).exists() for base in bases):
                absent.append(candidate)
    return absent


def test_every_named_file_exists():
    paths = named_paths(DOC)
    assert len(paths) > 30, paths  # the pattern still finds the doc's paths
    assert missing(paths) == []


def test_the_builder_functions_the_doc_names_exist():
    names = set(re.findall(r"`build_run\.([a-z_]+)`", DOC))
    assert {"objective_for", "plugins_for", "final_export_for", "build_runtime", "metric_sinks"} <= names
    assert [n for n in names if not callable(getattr(build_run, n, None))] == []


def test_the_plugin_tables_name_real_plugins():
    assert issubclass(NextTokenObjective, plugins.Objective) and issubclass(PreferenceObjective, plugins.Objective)
    assert issubclass(MoeStatistics, plugins.StepPlugin)
    assert issubclass(FullModelExport, plugins.FinalExport) and issubclass(AdapterExport, plugins.FinalExport)
    hooks = {"start_run", "start_step", "end_step", "untimed_seconds", "interval_metrics", "write_outputs",
             "summary_lines"}
    assert hooks <= set(vars(plugins.StepPlugin)) and all(f"`{h}(" in DOC for h in hooks)


def test_the_check_finds_a_missing_file():
    assert missing(["train/no_such_file.py", "models/<family>/model.py"]) == ["train/no_such_file.py"]
