"""The fine-tuning tests' inputs: the arithmetic task files and a tiny byte-level BPE with ChatML
markers trained on them in milliseconds (so the default ChatML template renders the rows)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.data.tasks import write_task_files

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def task_with_tokenizer(root: Path, *, seed: int, train: int, heldout: int,
                        vocab_size: int = 320) -> tuple[Path, dict[str, Path]]:
    """``(root, task file paths)`` with ``root/tokenizer.json`` trained on the SFT training file."""
    paths = write_task_files(root, seed=seed, train=train, heldout=heldout)
    chat_tokenizer(paths["sft_train"].read_text(), vocab_size).save(str(root / "tokenizer.json"))
    return root, paths
