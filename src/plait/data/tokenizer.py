"""Byte-level BPE tokenizers trained with Hugging Face ``tokenizers`` and cached on disk.

Training on a few MB of text takes about a second; the result is cached by a key of the inputs
so a second run reuses it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def cache_dir() -> Path:
    return Path(os.environ.get("PLAIT_CACHE", Path.home() / ".cache" / "plait"))


def train_bpe(documents: Iterable[str], vocab_size: int, cache_key: str | None = None) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` is id 0).

    ``documents`` may be any iterable (e.g. a generator streaming a large corpus) when ``cache_key``
    is given; without one the key is computed from the documents, which are then read as a list.
    """
    if cache_key is None and not isinstance(documents, list):
        documents = list(documents)
    key = cache_key or hashlib.sha256("".join(d[:1000] for d in documents).encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / f"bpe-{key}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok
