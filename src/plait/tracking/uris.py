"""Where a tracker's data goes, decided and checked before launch without importing the tracker.

``logging.mlflow.tracking_uri`` may name a tracking server (``http(s)://host[:port]``), a local
file store (``file:///path`` or a plain path), Databricks, or a database store (``sqlite:///``,
``postgresql://``, ...; those need SQLAlchemy, which MLflow's full package brings). Anything else
is refused before launch with the forms that work. A server is checked for a TCP connection, a
file store for a directory plait can create or write: the checks that catch a typo or a server
that is down while the user is still at the terminal.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import unquote, urlparse

from plait.tracking.settings import MlflowSettings

SERVER_SCHEMES = ("http", "https")
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
#: the forms a tracking URI may take, for error messages
URI_FORMS = "http(s)://host[:port], file:///absolute/path, a directory path, databricks, or sqlite:///file.db"
#: seconds a server has to accept a connection in the pre-launch check
CONNECT_TIMEOUT_S = 5.0


def tracking_uri_for(settings: MlflowSettings, run_dir: str | os.PathLike) -> str:
    """The tracking URI a run uses: the recipe's, else ``$MLFLOW_TRACKING_URI``, else ``<run dir>/mlruns``."""
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri if uri else (Path(run_dir) / "mlruns").resolve().as_uri()


def scheme_of(uri: str) -> str:
    """The URI's scheme, ``""`` for a plain path (a Windows drive letter is a path too)."""
    scheme = urlparse(uri).scheme.lower()
    return "" if len(scheme) <= 1 else scheme


def is_file_store(uri: str) -> bool:
    return scheme_of(uri) in ("", "file")


def file_store_path(uri: str) -> Path:
    """The directory of a ``file://`` URI or plain path."""
    if scheme_of(uri) == "file":
        parsed = urlparse(uri)
        return Path(unquote(parsed.path)).expanduser()
    return Path(uri).expanduser()


def uri_form_problem(uri: str) -> str | None:
    """Why ``uri`` is no tracking URI MLflow can use, or ``None`` (no I/O)."""
    scheme = scheme_of(uri)
    if scheme in SERVER_SCHEMES:
        return None if urlparse(uri).hostname else f"names no host; use {URI_FORMS}"
    if scheme == "file":
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            return "is a file URI with a host; a local store is file:///absolute/path (three slashes)"
        return None
    if scheme in ("", "databricks") or scheme in DATABASE_SCHEMES or scheme.split("+")[0] in DATABASE_SCHEMES:
        return None
    return f"has the unknown scheme {scheme!r}; use {URI_FORMS}"


def writable_directory_problem(path: Path) -> str | None:
    """Why no directory can be created or written at ``path``, or ``None``."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, so {path} cannot be created"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def unreachable_problem(url: str) -> str | None:
    """Why nothing accepts a TCP connection at ``url``'s host and port, or ``None``."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return f"has an invalid port; use {URI_FORMS}"
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        return f"nothing answers at {host}:{port} ({reason})"


__all__ = ["CONNECT_TIMEOUT_S", "file_store_path", "is_file_store", "scheme_of", "tracking_uri_for",
           "unreachable_problem", "uri_form_problem", "writable_directory_problem"]
