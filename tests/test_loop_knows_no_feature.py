"""The training loop knows no objective or feature: what a recipe turns on reaches it only through
the plug-in hooks (src/plait/train/plugins.py). A branch on a feature's recipe section or a
feature's module in the loop is what this test refuses, so the next feature is a plug-in."""

from __future__ import annotations

import ast
from pathlib import Path

import plait.train.trainer as trainer_module

#: recipe sections and fields (as the end of an attribute chain) that only a plug-in, the builder
#: or the end of run may read
FEATURE_FIELDS = (".lora", ".moe", ".preference", ".train.objective", ".data.format", ".train.compile",
                  ".detect_host_syncs", ".sample_tokens", ".sample_prompt", ".save_final", ".parallel.cp",
                  ".sequence_parallel", ".zero1")
#: packages of features the loop must not import
FEATURE_PACKAGES = ("plait.moe", "plait.lora", "plait.post_training", "plait.context_parallel",
                    "plait.checkpoint", "plait.inference", "plait.data.baseline")


def _loop_source() -> ast.Module:
    return ast.parse(Path(trainer_module.__file__).read_text())


def _chain(node: ast.expr) -> str:
    """``a.b.c`` of an attribute chain (``?`` for a part that is not a name)."""
    if isinstance(node, ast.Attribute):
        return f"{_chain(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def feature_reads(tree: ast.Module) -> list[str]:
    """``line: a.b.c`` for every attribute read of a feature's field, in source order."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _chain(node).endswith(FEATURE_FIELDS):
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {_chain(node)}"))
    return [text for *_, text in sorted(found)]


def feature_imports(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(FEATURE_PACKAGES):
            found.append(f"{node.lineno}: from {node.module}")
    return found


def test_the_loop_reads_no_feature_field_and_imports_no_feature():
    tree = _loop_source()
    assert feature_reads(tree) == [], "the loop branches on a feature; make it a plug-in (train/plugins.py)"
    assert feature_imports(tree) == [], "the loop imports a feature's package; reach it through a plug-in"


def test_the_check_finds_a_feature_branch():
    # negative control: the branches the loop used to have are found
    tree = ast.parse("if self.recipe.lora.rank is not None:\n    pass\nfrom plait.moe import read_moe_stats\n"
                     "if r.data.format == 'text':\n    pass\n")
    assert feature_reads(tree) == ["1: self.recipe.lora", "4: r.data.format"]
    assert feature_imports(tree) == ["3: from plait.moe"]
