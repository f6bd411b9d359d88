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


def base_and_adapter(root: Path, tokenizer: Tokenizer, *, max_position_embeddings: int):
    """A tiny random Llama saved as ``root/base`` (with the tokenizer) and a LoRA adapter on it with
    non-zero B, saved as ``root/adapter`` naming that base; returns ``(config, adapted model)``."""
    import torch

    from plait.lora import LoraSettings, apply_lora, save_peft_adapter
    from plait.materialize import build_model
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint
    from plait.models.llama.config import LlamaConfig

    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings)
    mesh = single_process_mesh()
    model = build_model(config, mesh, seed=1)
    save_hf_checkpoint(model, root / "base", mesh.info("tp"))
    tokenizer.save(str(root / "base" / "tokenizer.json"))
    apply_lora([model], LoraSettings(rank=2, alpha=4.0), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.normal_(0, 0.5)
    save_peft_adapter([model], root / "adapter", mesh.info("tp"), str(root / "base"))
    return config, model
