"""The built-in demo: 2-process tensor-parallel training of a tiny Llama on Shakespeare.

The parent process prepares the data once (byte-level BPE trained on the plays, token stream
cached on disk), then launches two ranks through PyTorch's elastic launcher. The ranks build
their TP=2 shards of the model (meta device, layout-invariant init), train with AdamW, print
the loss as it falls, and report the validation loss against a unigram baseline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DemoSettings:
    tp: int = 2
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    vocab_size: int = 2048
    lr: float = 3e-3
    seed: int = 0
    log_every: int = 20


def model_config(s: DemoSettings):
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab_size, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=s.seq_len,
                       tie_word_embeddings=True)


def prepare_data(s: DemoSettings) -> Path:
    """Tokenise Shakespeare once; returns the path of the cached ``{train, val}`` sequences."""
    from plait.data.corpora import corpus_documents
    from plait.data.sequences import split_sequences, token_stream
    from plait.data.tokenizer import cache_dir, train_bpe

    path = cache_dir() / f"demo-shakespeare-{s.vocab_size}-{s.seq_len}.pt"
    if not path.exists():
        print("preparing data: training a byte-level BPE on Shakespeare and tokenising ...", flush=True)
        docs = corpus_documents("shakespeare")
        tok = train_bpe(docs, s.vocab_size, cache_key="shakespeare-all")
        train, val = split_sequences(token_stream(docs, tok), s.seq_len)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"train": train, "val": val}, path)
    return path


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of the validation tokens under the training set's unigram distribution."""
    counts = torch.bincount(train.flatten(), minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[val[:, 1:].flatten()].mean().item()


def _worker(s: DemoSettings, data_path: str) -> None:
    from plait.launch import finish_worker, init_worker
    from plait.materialize import build_llama
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from plait.train.simple import evaluate, train_steps

    rank, world = init_worker()
    try:
        data = torch.load(data_path)
        cfg = model_config(s)
        mesh = ParallelMesh(world, rank, tp=s.tp, kv_replication=kv_replication_for(cfg, s.tp))
        model = build_llama(cfg, mesh, seed=s.seed)
        if rank == 0:
            print(f"{mesh}\nmodel: {cfg.num_parameters() / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers; "
                  f"{s.steps} steps of {s.batch_size}x{s.seq_len} tokens", flush=True)
        tokens_per_step = s.batch_size * s.seq_len
        t0 = time.perf_counter()

        def log(step: int, loss: float, seconds: float) -> None:
            if rank == 0 and (step % s.log_every == 0 or step == s.steps - 1):
                print(f"step {step:4d}  loss {loss:6.3f}  {tokens_per_step / seconds:7.0f} tok/s", flush=True)

        train_steps(model, data["train"], steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=s.seed, on_step=log)
        val = evaluate(model, data["val"][:64], s.batch_size)
        if rank == 0:
            base = unigram_loss(data["train"], data["val"], s.vocab_size)
            print(f"done in {time.perf_counter() - t0:.0f}s: validation loss {val:.3f} "
                  f"(perplexity {math.exp(val):.1f}); unigram baseline {base:.3f}", flush=True)
    finally:
        finish_worker()


def run_demo(s: DemoSettings = DemoSettings()) -> None:
    from plait.launch import launch_local

    path = prepare_data(s)
    launch_local(_worker, s.tp, s, str(path))
