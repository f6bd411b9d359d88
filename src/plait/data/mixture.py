"""Weighted mixtures of corpora (``data.sources``): prepared apart, one tokenizer, blended exactly.

Each source is prepared as a dataset of its own (:func:`~plait.data.prepare.prepare_dataset`,
its own validation split). All of them use one tokenizer: ``data.tokenizer``'s file, or, with
``bpe``, one BPE trained on the training documents of every source together (so no source's
validation text shapes it). A prepared source brings its own tokenizer; sources whose tokenizers
differ are refused. The mixture itself is a small directory (``index.json`` of format
``plait-mixture`` naming the parts, their weights and names, plus the shared tokenizer files,
which travel on to the trained model), keyed by its parts and weights.

The blend (:class:`MixtureSampler`) is a pure function of ``(seed, step)``, like the plain
sampler, so resuming needs only the step, in any layout. Weights are turned into whole counts
per period of :data:`PERIOD` samples (largest remainders: source ``i`` has ``c_i`` positions, the
counts sum to the period); positions are interleaved by their ideal times ``(j + 1/2) / c_i``, so
every prefix of the period holds within two samples of each source's share (one global batch
holds its share of each source up to that rounding). Global sample ``k``
is position ``k mod PERIOD`` of period ``k // PERIOD``; its source ``s`` and its ordinal
``o = period * c_s + j`` within that source; the source's ``o``-th sample is
``perm_{s,e}[o mod n_s]`` in the source's epoch ``e = o // n_s`` (a permutation drawn from
``(seed, s, e)``). So each source goes through all its samples before repeating any, whatever
its weight, and the counts per source are exact per period.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from plait.data.errors import DataError
from plait.data.prepare import prepare_dataset, prepared_source, source_key_parts, source_name, training_texts
from plait.data.sampler import GlobalBatchSampler
from plait.data.token_shards import INDEX_FILE, TOKENIZER_FILE, TokenDataset, load_index
from plait.data.tokenizer import cache_dir as resolve_cache_dir
from plait.data.tokenizer import train_bpe
from plait.data.tokenizer_files import copy_model_use_files, file_sha256

#: ``index.json`` ``format`` of a mixture directory
MIXTURE_FORMAT = "plait-mixture"
MIXTURE_VERSION = 1
#: samples per blend period: weights are resolved to 1 / PERIOD
PERIOD = 1 << 16


class MixtureError(DataError):
    """A mixture that cannot be built: different tokenizers, repeated names, a weight too small."""


@dataclass(frozen=True)
class MixturePart:
    """One prepared source of a mixture."""

    name: str
    directory: Path
    weight: float  # normalised: the weights of a mixture sum to 1


def blend_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Whole positions per source in a period: ``weights`` scaled to ``period``, largest remainders
    rounded up, so they sum to ``period`` exactly; a source left with none is refused."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum() * period
    counts = np.floor(share).astype(np.int64)
    rest = period - int(counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    if (counts == 0).any():
        raise MixtureError(f"a weight of {float(w[counts == 0].min() / w.sum()):.2e} of the total is below one "
                           f"sample in {period}; raise it or remove the source")
    return counts


def blend_pattern(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source of each position, its ordinal within the source) over one period: the positions of
    source ``i`` at ideal times ``(j + 1/2) / c_i``, merged in time order (ties by source)."""
    sources = np.repeat(np.arange(len(counts)), counts)
    ordinals = np.concatenate([np.arange(c) for c in counts])
    times = (ordinals + 0.5) / counts[sources]
    order = np.lexsort((sources, times))
    return sources[order], ordinals[order]


class MixtureSampler(GlobalBatchSampler):
    """Global batches drawn from several sources with exact shares; indices address the
    concatenation of the sources' samples (source ``s`` starts at ``offsets[s]``)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int = 0,
                 period: int = PERIOD):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"sizes {list(sizes)} and weights {list(weights)} must be two lists of one length")
        super().__init__(int(sum(sizes)), global_batch_size, seed)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.period = period
        self.counts = blend_counts(weights, period)
        self.pattern, self.ordinals = blend_pattern(self.counts)
        self._source_perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._source_lock = threading.Lock()

    def _source_permutation(self, source: int, epoch: int) -> np.ndarray:
        with self._source_lock:
            key = (source, epoch)
            perm = self._source_perms.get(key)
            if perm is None:
                perm = np.random.default_rng([self.seed, source, epoch]).permutation(int(self.sizes[source]))
                self._source_perms[key] = perm
                while len(self._source_perms) > 2 * len(self.sizes):
                    self._source_perms.popitem(last=False)
            else:
                self._source_perms.move_to_end(key)
            return perm

    def source_of(self, start: int, stop: int) -> np.ndarray:
        """The source of each of global samples ``start .. stop-1``."""
        return self.pattern[np.arange(start, stop) % self.period]

    def samples(self, start: int, stop: int) -> list[int]:
        if start < 0 or stop < start:
            raise ValueError(f"sample range [{start}, {stop}) is not valid")
        k = np.arange(start, stop, dtype=np.int64)
        period, pos = np.divmod(k, self.period)
        source = self.pattern[pos]
        ordinal = period * self.counts[source] + self.ordinals[pos]
        epoch, within = np.divmod(ordinal, self.sizes[source])
        out = np.empty(len(k), dtype=np.int64)
        for s, e in sorted(set(zip(source.tolist(), epoch.tolist(), strict=True))):
            mask = (source == s) & (epoch == e)
            out[mask] = self.offsets[s] + self._source_permutation(s, e)[within[mask]]
        return out.tolist()


class MixtureDataset(torch.utils.data.Dataset):
    """The samples of every part of a mixture, concatenated in part order (what
    :class:`MixtureSampler` indexes); ``parts`` holds each part's own :class:`TokenDataset`."""

    def __init__(self, mixture_dir: str | Path, split: str = "train", seq_len: int = 1024):
        self.directory = Path(mixture_dir)
        self.index = load_mixture_index(self.directory)
        self.split, self.seq_len = split, seq_len
        self.names = [p["name"] for p in self.index["parts"]]
        self.weights = [float(p["weight"]) for p in self.index["parts"]]
        self.parts = [TokenDataset(p["directory"], split, seq_len) for p in self.index["parts"]]
        self.sizes = [len(p) for p in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.vocab_size: int = int(self.index["vocab_size"])
        self.eos_id: int = int(self.index["eos_id"])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} {self.split} samples of the mixture")
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return part, i - int(self.offsets[part])

    def __getitem__(self, i: int) -> torch.Tensor:
        part, j = self._locate(int(i))
        return self.parts[part][j]

    def batch(self, indices: list[int]) -> torch.Tensor:
        out = torch.empty((len(indices), self.seq_len), dtype=torch.int64)
        located = [self._locate(int(i)) for i in indices]
        for part in sorted({p for p, _ in located}):
            rows = [r for r, (p, _) in enumerate(located) if p == part]
            out[rows] = self.parts[part].batch([located[r][1] for r in rows])
        return out

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.directory / TOKENIZER_FILE))


# ------------------------------------------------------------------------------------------ on disk

def load_mixture_index(directory: Path) -> dict:
    path = directory / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MixtureError(f"{path}: not a readable mixture index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != MIXTURE_FORMAT or index.get("version") != MIXTURE_VERSION:
        raise MixtureError(f"{path}: not a plait mixture index of version {MIXTURE_VERSION}")
    return index


def is_mixture(directory: str | Path) -> bool:
    path = Path(directory) / INDEX_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == MIXTURE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_same_tokenizer(parts: Sequence[tuple[str, Path]]) -> str:
    """The sha256 of the one tokenizer of every prepared part; parts of different tokenizers are refused."""
    digests = {name: str(load_index(d).get("tokenizer_sha256") or file_sha256(d / TOKENIZER_FILE))
               for name, d in parts}
    if len(set(digests.values())) > 1:
        listed = ", ".join(f"{name}: {digest[:12]}" for name, digest in digests.items())
        raise MixtureError(f"data.sources use different tokenizers ({listed}); a mixture trains one model on one "
                           f"vocabulary: prepare every source with the same data.tokenizer")
    return next(iter(digests.values()))


def write_mixture(parts: Sequence[MixturePart], out_root: Path) -> Path:
    """The mixture directory of ``parts`` under ``out_root`` (reused when it exists with this key)."""
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise MixtureError(f"data.sources name two sources {repeated[0]!r}; give each a distinct name "
                           f"(data.sources[i].name), since the name labels its val_loss/<name>")
    sha = check_same_tokenizer([(p.name, p.directory) for p in parts])
    indexes = [load_index(p.directory) for p in parts]
    described = [{"name": p.name, "directory": str(p.directory.resolve()), "weight": p.weight, "key": ix.get("key"),
                  "train_tokens": ix.get("train_tokens"), "val_tokens": ix.get("val_tokens")}
                 for p, ix in zip(parts, indexes, strict=True)]
    key = hashlib.sha256(json.dumps([{k: d[k] for k in ("name", "directory", "weight", "key")} for d in described],
                                    sort_keys=True).encode()).hexdigest()[:16]
    out = out_root / f"mixture-{key}"
    if out.is_dir() and is_mixture(out) and load_mixture_index(out).get("key") == key:
        return out
    index = {"format": MIXTURE_FORMAT, "version": MIXTURE_VERSION, "key": key, "parts": described,
             "tokenizer": TOKENIZER_FILE, "tokenizer_sha256": sha, "vocab_size": indexes[0]["vocab_size"],
             "eos_id": indexes[0]["eos_id"], "eos_token": indexes[0].get("eos_token")}
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        copy_model_use_files(tmp, parts[0].directory / TOKENIZER_FILE)  # the tokenizer and what travels with it
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, out)
        except OSError:
            if is_mixture(out) and load_mixture_index(out).get("key") == key:  # a concurrent run finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            raise MixtureError(f"{out} exists and is not this mixture; plait does not replace what it did not "
                               f"write: remove it or choose another data.cache_dir") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------------------- preparing

@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``data.sources`` as the preparation needs it."""

    source: str
    weight: float
    name: str | None = None
    fields: tuple[tuple[str, str], ...] = ()
    limit: int | None = None


def _shared_tokenizer(specs: Sequence[SourceSpec], *, tokenizer: str, vocab_size: int, val_fraction: float,
                      seed: int, cache: Path, progress: bool) -> str:
    """The tokenizer every source is prepared with: ``tokenizer``'s file, a prepared source's own
    (with ``bpe``), or one BPE trained on every source's training documents, cached by their key."""
    prepared = [p for p in (prepared_source(s.source) for s in specs) if p is not None]
    if len(prepared) > 1:
        check_same_tokenizer([(p.name, p) for p in prepared])
    if tokenizer != "bpe":
        return tokenizer
    if prepared:
        return str(prepared[0] / TOKENIZER_FILE)  # the others must match it (checked when they are prepared)
    digest = hashlib.sha256()
    for spec in specs:
        for part in [*source_key_parts(spec.source, dict(spec.fields)), f"limit={spec.limit}"]:
            digest.update(part.encode() + b"\0")
    digest.update(f"vocab={vocab_size};val_fraction={float(val_fraction)!r};seed={seed}".encode())
    key = digest.hexdigest()[:16]
    path = cache / "tokenizers" / f"mixture-{key}-{vocab_size}" / TOKENIZER_FILE
    if not path.is_file():
        if progress:
            print(f"training one BPE of {vocab_size} tokens on the training documents of {len(specs)} sources",
                  flush=True)
        texts = itertools.chain.from_iterable(
            training_texts(s.source, fields=dict(s.fields), val_fraction=val_fraction, seed=seed, limit=s.limit)
            for s in specs)
        tok = train_bpe(texts, vocab_size, cache_key=f"mixture-{key}", cache_root=cache)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{TOKENIZER_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tok.save(str(partial))
        os.replace(partial, path)
    return str(path)


def prepare_mixture(specs: Sequence[SourceSpec], *, tokenizer: str = "bpe", vocab_size: int = 2048,
                    val_fraction: float = 0.05, seed: int = 0, cache_dir: str | Path | None = None,
                    progress: bool = False, workers: int = 1) -> Path:
    """Prepare every source with one tokenizer and write (or find) the mixture directory naming them."""
    if len(specs) < 2:
        raise MixtureError(f"data.sources holds {len(specs)} source; a mixture needs two or more (one source is "
                           f"data.source)")
    cache = resolve_cache_dir(cache_dir)
    shared = _shared_tokenizer(specs, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                               seed=seed, cache=cache, progress=progress)
    total = sum(s.weight for s in specs)
    parts = []
    for i, spec in enumerate(specs):
        try:
            directory = prepare_dataset(spec.source, tokenizer=shared, vocab_size=vocab_size,
                                        val_fraction=val_fraction, seed=seed, progress=progress, limit=spec.limit,
                                        cache_dir=cache_dir, fields=dict(spec.fields), workers=workers)
        except DataError as exc:
            raise type(exc)(f"data.sources[{i}] ({spec.source}): {exc}") from None
        name = spec.name or source_name(spec.source, dict(spec.fields))
        parts.append(MixturePart(name, directory, spec.weight / total))
    return write_mixture(parts, cache / "datasets")
