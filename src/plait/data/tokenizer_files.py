"""The files beside a model's weights that say how the model is used, and their identity.

A model directory is more than ``config.json`` and the weights: the tokenizer
(``tokenizer.json``), its settings and special tokens (``tokenizer_config.json``,
``special_tokens_map.json``), the chat template (a ``chat_template`` entry of
``tokenizer_config.json`` or a ``chat_template.jinja`` file) and the decoding defaults
(``generation_config.json``). A model fine-tuned on conversations rendered with one template
answers well only when it is prompted with the same template, so every model directory plait
writes (a run's final model, a LoRA adapter, a merged adapter, a converted checkpoint) carries
these files, chosen by one rule (:func:`model_use_files`) and copied by one function
(:func:`copy_model_use_files`):

* the tokenizer files are one group, taken together from the first source that has a
  ``tokenizer.json``, never mixed from two sources (a chat template of the base model next to
  the tokenizer a run was trained with would render prompts the model never saw);
* ``generation_config.json`` is taken from the first source that has one.

A source is a directory or a tokenizer file (any name; the other files are those of its
directory). The identity of a tokenizer is the sha256 of its ``tokenizer.json`` bytes
(:func:`tokenizer_sha256`): two tokenizers of the same vocabulary size are told apart.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
#: what the rendered rows depend on besides tokenizer.json (settings, special tokens, chat template)
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
GENERATION_CONFIG = "generation_config.json"
#: every file that travels with a model directory
MODEL_USE_FILES = (TOKENIZER_FILE, *TOKENIZER_COMPANIONS, GENERATION_CONFIG)

Source = str | os.PathLike | None


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """A tokenizer's identity: the sha256 of its ``tokenizer.json`` (a directory: the one inside)."""
    p = Path(path)
    return file_sha256(p / TOKENIZER_FILE if p.is_dir() else p)


def _tokenizer_and_folder(source: str | os.PathLike) -> tuple[Path | None, Path]:
    path = Path(source).expanduser()
    if path.is_file():
        return path, path.parent
    return (path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else None), path


def model_use_files(*sources: Source) -> dict[str, Path]:
    """``{name in the model directory: file}`` for the files of :data:`MODEL_USE_FILES` the
    ``sources`` (directories or tokenizer files, in order of preference; ``None`` is skipped)
    provide, by the rule of the module doc."""
    found: dict[str, Path] = {}
    for source in sources:
        if source is None or not str(source):
            continue
        tokenizer, folder = _tokenizer_and_folder(source)
        if tokenizer is not None and TOKENIZER_FILE not in found:
            found[TOKENIZER_FILE] = tokenizer
            found.update({name: folder / name for name in TOKENIZER_COMPANIONS if (folder / name).is_file()})
        if GENERATION_CONFIG not in found and (folder / GENERATION_CONFIG).is_file():
            found[GENERATION_CONFIG] = folder / GENERATION_CONFIG
    return found


def model_use_digests(*sources: Source) -> dict[str, str]:
    """``{name: sha256}`` of :func:`model_use_files` (for a cache key or an index)."""
    return {name: file_sha256(path) for name, path in sorted(model_use_files(*sources).items())}


def copy_model_use_files(directory: str | os.PathLike, *sources: Source) -> list[str]:
    """Copy the files :func:`model_use_files` picks from ``sources`` into ``directory``; returns their names."""
    files = model_use_files(*sources)
    for name, path in files.items():
        target = Path(directory) / name
        if target.exists() and target.samefile(path):
            continue
        shutil.copyfile(path, target)
    return sorted(files)


__all__ = ["GENERATION_CONFIG", "MODEL_USE_FILES", "TOKENIZER_COMPANIONS", "TOKENIZER_FILE", "copy_model_use_files",
           "file_sha256", "model_use_digests", "model_use_files", "tokenizer_sha256"]
