"""``logging.wandb`` and ``logging.mlflow``: what would make a tracker fail is found before launch.

A tracker that is not installed, a W&B run meant to go online without an API key or without a
path to the server, a tracking URI of an unknown form, a server that does not answer, or a
directory that cannot be written is one line naming the field, the value and the fix. Those are
machine checks, skipped for a recipe meant for another machine (``check_paths=False``); the form
of a URI is always checked. What can still go wrong mid-run (a server that goes away) only
warns: :mod:`plait.tracking.background`.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from plait.config.rules.checker import Checker
from plait.tracking.settings import MlflowSettings, WandbSettings
from plait.tracking.uris import (
    file_store_path,
    is_file_store,
    scheme_of,
    unreachable_problem,
    uri_form_problem,
    writable_directory_problem,
)

#: the W&B server asked when ``WANDB_BASE_URL`` is not set
WANDB_DEFAULT_URL = "https://api.wandb.ai"


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _output_dir(c: Checker) -> Path | None:
    if not c.ok("run.output_dir", "run.name"):
        return None
    try:
        return Path(os.path.expanduser(c.r.run.output_dir.format(name=c.r.run.name)))
    except (KeyError, IndexError, ValueError, AttributeError):
        return None  # reported by the paths rule


def wandb_api_key_found(base_url: str) -> bool:
    """Whether W&B would find an API key: ``WANDB_API_KEY``, or a netrc entry for the server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(base_url).hostname or ""
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def check_trackers(c: Checker) -> None:
    lg = c.r.logging
    if lg.wandb is not None and c.ok("logging.wandb"):
        _check_wandb(c, lg.wandb)
    if lg.mlflow is not None and c.ok("logging.mlflow"):
        _check_mlflow(c, lg.mlflow)


def _check_wandb(c: Checker, w: WandbSettings) -> None:
    if not c.check_paths:
        return
    if not installed("wandb"):
        c.add("logging.wandb", w.model_dump(), "W&B is not installed here; pip install wandb, or set "
                                               "logging.wandb=null")
        return
    if w.dir is not None:
        problem = writable_directory_problem(Path(w.dir).expanduser())
        if problem:
            c.add("logging.wandb.dir", w.dir, f"{problem}; name a directory W&B may write, or null for the run's "
                                              f"output directory")
    mode = w.mode or os.environ.get("WANDB_MODE") or "online"
    if mode in ("offline", "dryrun", "disabled"):
        return
    shown = w.mode or f"null ($WANDB_MODE is {os.environ.get('WANDB_MODE') or 'unset'}: online)"
    base = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
    offline = "or set logging.wandb.mode=offline and upload later with `wandb sync`"
    if not wandb_api_key_found(base):
        c.add("logging.wandb.mode", shown, f"online logging needs a W&B API key for {base} (set WANDB_API_KEY "
                                           f"or run `wandb login`); {offline}")
        return
    problem = unreachable_problem(base)
    if problem:
        c.add("logging.wandb.mode", shown, f"the W&B server {base}: {problem}; check the network (or "
                                           f"$WANDB_BASE_URL), {offline}")


def _check_mlflow(c: Checker, m: MlflowSettings) -> None:
    field, uri = "logging.mlflow.tracking_uri", m.tracking_uri
    if uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        uri = os.environ["MLFLOW_TRACKING_URI"]
        field = "logging.mlflow.tracking_uri (null: $MLFLOW_TRACKING_URI)"
    if uri is not None:
        problem = uri_form_problem(uri)
        if problem:
            c.add(field, uri, problem)
            return
    if not c.check_paths:
        return
    if not installed("mlflow"):
        c.add("logging.mlflow", m.model_dump(), "MLflow is not installed here; pip install mlflow-skinny (or "
                                                "mlflow), or set logging.mlflow=null")
        return
    if uri is None:
        out = _output_dir(c)
        if out is not None:
            problem = writable_directory_problem(out / "mlruns")
            if problem:
                c.add("logging.mlflow.tracking_uri", None, f"the default store in the run's output directory: "
                                                           f"{problem}; name a tracking_uri")
        return
    scheme = scheme_of(uri)
    if is_file_store(uri):
        problem = writable_directory_problem(file_store_path(uri))
        if problem:
            c.add(field, uri, f"{problem}; name a directory MLflow may write (file:///absolute/path)")
    elif scheme in ("http", "https"):
        problem = unreachable_problem(uri)
        if problem:
            c.add(field, uri, f"{problem}; start the server or fix the address")
    elif scheme != "databricks" and not installed("sqlalchemy"):
        c.add(field, uri, "a database store needs SQLAlchemy (pip install mlflow, the full package); or use a "
                          "file:///path store or an http(s):// server")
