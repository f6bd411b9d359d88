"""Sampling (greedy, top-k, top-p, seeds, EOS, context truncation, TP agreement) and ``plait generate``."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from distributed import run_distributed


def _config(**kw):
    from plait.models.llama import LlamaConfig

    base = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    base.update(kw)
    return LlamaConfig(**base)


def _model(seed=0, **kw):
    from builders import build_llama
    from plait.mesh import single_process_mesh

    return build_llama(_config(**kw), single_process_mesh(), seed=seed)


PROMPT = torch.tensor([[3, 14, 15, 9, 26]])


# ------------------------------------------------------------------------------------ filters
def test_top_p_keeps_smallest_set_reaching_p():
    from plait.inference import top_p_filter

    probs = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])  # sorted: 0.5, 0.25, 0.125, 0.0625, 0.0625
    logits = probs.log()
    kept = lambda p: set(torch.nonzero(torch.isfinite(top_p_filter(logits, p))).flatten().tolist())  # noqa: E731
    assert kept(0.4) == {1}  # 0.5 alone reaches 0.4
    assert kept(0.5001) == {1, 3}
    assert kept(0.7) == {1, 3}  # 0.75 >= 0.7
    assert kept(0.8) == {1, 3, 0}  # 0.875 >= 0.8
    assert kept(0.9) in ({0, 1, 2, 3}, {0, 1, 3, 4})  # 0.875 < 0.9: one of the tied 0.0625s joins
    assert kept(1.0) == {0, 1, 2, 3, 4}
    assert kept(1e-9) == {1}  # the most likely token is always kept
    # surviving logits are unchanged, so renormalising gives the conditional distribution
    out = top_p_filter(logits, 0.7)
    assert torch.softmax(out, -1)[[1, 3]].tolist() == pytest.approx([2 / 3, 1 / 3])
    batched = top_p_filter(torch.stack([logits, logits.flip(0)]), 0.7)
    assert torch.isfinite(batched).sum(-1).tolist() == [2, 2]


def test_top_k_filter():
    from plait.inference import top_k_filter

    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3])
    assert torch.isfinite(top_k_filter(logits, 2)).tolist() == [False, True, False, True, False]
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_next_tokens_follow_the_distribution():
    from plait.inference import Sampling, next_tokens
    from plait.inference.sampling import row_generators

    gens = row_generators([0])
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf]])  # p = 1/4, 3/4, 0
    draws = [int(next_tokens(logits, Sampling(), gens)[0]) for _ in range(4000)]
    assert 2 not in draws
    assert draws.count(1) / len(draws) == pytest.approx(0.75, abs=0.03)
    # temperature -> 0 concentrates on the argmax
    cold = [int(next_tokens(logits, Sampling(temperature=0.05), gens)[0]) for _ in range(200)]
    assert set(cold) == {1}
    # a temperature whose scaled logits overflow is the argmax
    assert int(next_tokens(torch.tensor([[0.0, 1.0, 0.5]]), Sampling(temperature=1e-310), gens)[0]) == 1


def test_a_rows_draws_do_not_depend_on_its_batch():
    """Each row has its own generator: the same seed gives the same token alone or in a batch."""
    from plait.inference import Sampling, next_tokens
    from plait.inference.sampling import row_generators

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampling(temperature=1.2, top_p=0.9)
    together = [next_tokens(logits, s, row_generators([10, 11, 12, 13])).tolist() for _ in range(1)][0]
    alone = [int(next_tokens(logits[r:r + 1], s, row_generators([10 + r]))[0]) for r in range(4)]
    assert together == alone


# ------------------------------------------------------------------------------------ generate
def test_greedy_is_deterministic_and_equals_stepwise_argmax():
    from plait.inference import generate

    model = _model()
    out = generate(model, PROMPT, 12, greedy=True)
    assert out.shape == (1, 5 + 12) and torch.equal(out[:, :5], PROMPT)
    assert torch.equal(generate(model, PROMPT, 12, greedy=True, seed=123), out)
    ids = PROMPT.clone()
    with torch.no_grad():
        for _ in range(12):
            nxt = model(ids)[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert torch.equal(ids, out)
    assert model.training  # mode restored


def test_top_k_one_equals_greedy_and_seeds_reproduce():
    from plait.inference import generate

    model = _model()
    greedy = generate(model, PROMPT, 10, greedy=True)
    for seed in (0, 1, 7):
        assert torch.equal(generate(model, PROMPT, 10, top_k=1, seed=seed, temperature=1.7), greedy)
    a = generate(model, PROMPT, 16, seed=5, temperature=1.5)
    assert torch.equal(generate(model, PROMPT, 16, seed=5, temperature=1.5), a)
    others = [generate(model, PROMPT, 16, seed=s, temperature=1.5) for s in (6, 7, 8)]
    assert any(not torch.equal(a, o) for o in others)


def test_eos_stops_and_the_context_limit_is_refused():
    from plait.inference import generate

    model = _model(max_position_embeddings=25)
    out = generate(model, PROMPT, 20, greedy=True)  # exactly the 25 positions of the model
    assert out.shape == (1, 25)
    eos = int(out[0, 8])
    first = next(i for i in range(5, 25) if int(out[0, i]) == eos)
    stopped = generate(model, PROMPT, 20, greedy=True, eos_id=[eos, 10_000])
    assert torch.equal(stopped, out[:, : first + 1])
    assert generate(model, PROMPT, 0).shape == (1, 5)
    with pytest.raises(ValueError, match=r"max_position_embeddings=25\); ask for at most 20 new tokens"):
        generate(model, PROMPT, 21, greedy=True)


def test_generate_rejects_bad_arguments():
    from plait.inference import generate

    model = _model()
    with pytest.raises(ValueError, match=r"\[1, n\]"):
        generate(model, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, PROMPT, 2, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, PROMPT, 2, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, PROMPT, 2, top_k=-1)


def _tp_generate(rank, world, seed):
    from builders import build_llama
    from plait.inference import generate
    from plait.mesh import ParallelMesh

    mesh = ParallelMesh(world, rank, tp=world)
    model = build_llama(_config(), mesh, seed=0)
    return generate(model, PROMPT, 12, seed=seed, temperature=1.3, top_p=0.95)


def test_tp_ranks_draw_the_same_tokens():
    from plait.inference import generate

    outs = run_distributed(_tp_generate, 2, 3)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], generate(_model(), PROMPT, 12, seed=3, temperature=1.3, top_p=0.95))


# ------------------------------------------------------------------------------------ command
DOCS = ["the quick brown fox jumps over the lazy dog. " * 3, "to be or not to be, that is the question. " * 3,
        "all the world's a stage, and all the men and women merely players. " * 2] * 5


def _parse(argv):
    from plait.commands import generate as cmd

    parser = argparse.ArgumentParser(prog="plait")
    cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["generate", *argv])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from builders import build_llama
    from plait.data.tokenizer import train_bpe
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint

    root = tmp_path_factory.mktemp("gen")
    with pytest.MonkeyPatch.context() as mp:  # keep the tokenizer out of the user's cache
        mp.setenv("PLAIT_CACHE", str(root / "cache"))
        tok = train_bpe(DOCS, 300, cache_key="test-generate-cmd")
    run = root / "run"
    run.mkdir()
    tok.save(str(run / "tokenizer.json"))
    cfg = _config(vocab_size=tok.get_vocab_size(), max_position_embeddings=64, tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=2)  # default-like eos on an ordinary byte token
    model = build_llama(cfg, single_process_mesh(), seed=0)
    save_hf_checkpoint(model, run / "final", single_process_mesh().info("tp"))
    return run


def test_generate_command_on_saved_run(run_dir, capsys):
    from plait.commands.generate import run

    argv = ["--run", str(run_dir), "--prompt", "the quick", "--max-new-tokens", "8", "--greedy"]
    assert run(_parse(argv)) == 0
    first = capsys.readouterr().out
    assert first.startswith("the quick") and len(first.strip()) > len("the quick")
    assert run(_parse(argv)) == 0
    assert capsys.readouterr().out == first  # greedy: the same text again
    sampled = ["--run", str(run_dir), "--max-new-tokens", "6", "--top-k", "20", "--top-p", "0.9",
               "--temperature", "0.8", "--seed", "4"]
    assert run(_parse(sampled)) == 0  # empty prompt starts from <|endoftext|>
    out1 = capsys.readouterr().out
    assert run(_parse(sampled)) == 0
    assert capsys.readouterr().out == out1


def test_generate_command_on_hf_dir(run_dir, capsys, tmp_path):
    import shutil

    from plait.commands.generate import run

    hf = tmp_path / "hf"
    shutil.copytree(run_dir / "final", hf)
    shutil.copy(run_dir / "tokenizer.json", hf / "tokenizer.json")
    assert run(_parse(["--hf", str(hf), "--prompt", "to be", "--max-new-tokens", "5", "--greedy"])) == 0
    assert capsys.readouterr().out.startswith("to be")


def test_start_and_stop_ids(run_dir):
    from tokenizers import Tokenizer

    from plait.commands.generate import start_and_stop_ids
    from plait.models.hf_io import load_hf_config

    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    start, stop = start_and_stop_ids(tok, load_hf_config(run_dir / "final"))
    assert start == 0 and stop == {0}  # eos_token_id=2 is an ordinary byte here: not a stop


def test_generate_command_errors(run_dir, tmp_path, capsys):
    import shutil

    from plait.commands.generate import run

    def error(argv):
        assert run(_parse(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plait generate: ") and "\n" not in err
        return err

    assert "does not exist" in error(["--run", str(tmp_path / "nope")])
    (tmp_path / "empty_run").mkdir()
    assert "no final/" in error(["--run", str(tmp_path / "empty_run")])
    no_tok = tmp_path / "no_tok"
    shutil.copytree(run_dir / "final", no_tok / "final")
    assert "tokenizer.json" in error(["--run", str(no_tok)])
    hf = tmp_path / "hf"
    hf.mkdir()
    assert "config.json" in error(["--hf", str(hf)])
    shutil.copy(run_dir / "final" / "config.json", hf)
    assert "safetensors" in error(["--hf", str(hf)])
    for f in (run_dir / "final").glob("*.safetensors"):
        shutil.copy(f, hf)
    assert "tokenizer.json" in error(["--hf", str(hf)])
    assert "--top-p" in error(["--run", str(run_dir), "--top-p", "1.5"])
    assert "--temperature" in error(["--run", str(run_dir), "--temperature", "0"])
    with pytest.raises(SystemExit):  # argparse: --run and --hf are exclusive, one is required
        _parse([])


def test_text_stream_never_writes_what_it_must_take_back():
    """A character split over tokens, whitespace around a chat answer and the start of a stop
    string wait until they settle; what was streamed equals the final text."""
    import io

    from plait.inference.streaming import TextStream

    pieces = ["  ", "caf", "\ufffd", "é", " x", "EN", "D", "!"]  # token i decodes to the join of pieces[:i+1]
    decode = lambda ids: "".join(pieces[i] for i in ids).replace("\ufffdé", "é")  # noqa: E731
    out = io.StringIO()
    stream = TextStream(decode, out, strip=True, stop_strings=("END",))
    seen = []
    for token in range(7):
        stream.add(token)
        seen.append(out.getvalue())
    assert seen == ["", "caf", "caf", "café", "café x", "café x", "café x"]
    stream.close("café x")
    assert out.getvalue() == "café x"
