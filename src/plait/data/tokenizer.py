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

from plait.data.errors import DataError

EOS = "<|endoftext|>"
# End-of-text tokens looked up, in order, in a tokenizer given as a file.
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>")


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """plait's cache: ``root`` when given (``data.cache_dir``, ``--cache-dir``), else ``$PLAIT_CACHE``,
    else ``~/.cache/plait``."""
    if root is not None and str(root):
        return Path(root).expanduser()
    return Path(os.environ.get("PLAIT_CACHE", Path.home() / ".cache" / "plait"))


def load_tokenizer_file(path: str | os.PathLike) -> Tokenizer:
    """A ``tokenizer.json``, or a :class:`DataError` naming the file."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception on malformed files
        raise DataError(f"tokenizer {path}: cannot be loaded ({str(exc).splitlines()[0]})") from None


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """One past the largest id (added tokens may sit above ``get_vocab_size()``)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def find_eos(tokenizer: Tokenizer) -> tuple[str, int]:
    """The end-of-text token and its id: the first of :data:`EOS_CANDIDATES` the tokenizer has."""
    for token in EOS_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return token, tid
    raise DataError(f"the tokenizer has no end-of-text token; looked for {', '.join(EOS_CANDIDATES)}")


def train_bpe(documents: Iterable[str], vocab_size: int, cache_key: str | None = None,
              cache_root: str | os.PathLike | None = None) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` is id 0).

    ``documents`` may be any iterable (e.g. a generator streaming a large corpus) when ``cache_key``
    is given; without one the key is computed from the documents, which are then read as a list.
    The result is cached under ``cache_dir(cache_root)/tokenizers``.
    """
    if cache_key is None and not isinstance(documents, list):
        documents = list(documents)
    key = cache_key or hashlib.sha256("".join(d[:1000] for d in documents).encode()).hexdigest()[:16]
    path = cache_dir(cache_root) / "tokenizers" / f"bpe-{key}-{vocab_size}.json"
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
