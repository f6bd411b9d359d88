"""``plait generate`` and ``plait plan`` at their edges: bad devices, damaged weights, runs without
a final checkpoint, option values no plan can use, the CPU device on worlds above 1, the progress
bar, and help text that matches what the trainer supports. Each case is one line on stderr with
exit status 2 (or a working plan), never a traceback."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DOCS = ["the quick brown fox jumps over the lazy dog. " * 3, "to be or not to be, that is the question. " * 3,
        "all the world's a stage, and all the men and women merely players. " * 2] * 5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face directory (config, one model.safetensors, tokenizer) to generate from."""
    from builders import build_llama
    from plait.data.tokenizer import train_bpe
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint
    from plait.models.llama import LlamaConfig

    root = tmp_path_factory.mktemp("edges")
    with pytest.MonkeyPatch.context() as mp:  # keep the tokenizer out of the user's cache
        mp.setenv("PLAIT_CACHE", str(root / "cache"))
        tok = train_bpe(DOCS, 300, cache_key="test-command-edges")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=None)
    model = build_llama(cfg, single_process_mesh(), seed=0)
    out = root / "hf"
    save_hf_checkpoint(model, out, single_process_mesh().info("tp"))
    tok.save(str(out / "tokenizer.json"))
    return out


def _fails(capsys, argv: list[str]) -> str:
    """Run ``plait ARGV`` in process; it must exit 2 with exactly one line on stderr."""
    from plait.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


# ------------------------------------------------------------------------------ generate
@pytest.mark.parametrize("device", ["nonsense", "cuda:99", "mps"])
def test_generate_device_this_build_lacks(hf_dir, capsys, device):
    import torch

    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    err = _fails(capsys, ["generate", "--hf", str(hf_dir), "--device", device, "--max-new-tokens", "2"])
    assert err.startswith("plait generate: --device") and repr(device) in err
    assert "available here: cpu" in err


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) - 100])


def test_generate_truncated_weights(hf_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    _truncate(hf / "model.safetensors")
    err = _fails(capsys, ["generate", "--hf", str(hf), "--max-new-tokens", "2"])
    assert str(hf / "model.safetensors") in err and "truncated or corrupt" in err
    run = tmp_path / "run"  # the same file in a run's final/
    shutil.copytree(hf, run / "final")
    shutil.copy(hf / "tokenizer.json", run / "tokenizer.json")
    err = _fails(capsys, ["generate", "--run", str(run), "--max-new-tokens", "2"])
    assert str(run / "final" / "model.safetensors") in err and "truncated or corrupt" in err


def _run_without_final(root: Path, *, save_final: bool, checkpoint: bool) -> Path:
    """A run directory as the trainer leaves it without a final/: resolved recipe, tokenizer and
    (optionally) one complete training checkpoint."""
    import yaml

    from plait.checkpoint.format import FORMAT, MANIFEST, VERSION

    run = root / "run"
    run.mkdir()
    recipe = {"run": {"name": "x", "output_dir": str(run)},
              "checkpoint": {"save_final": save_final, "dir": str(run / "final"),
                             "save_dir": str(run / "checkpoints")}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (run / "tokenizer.json").write_text("{}")
    if checkpoint:
        step = run / "checkpoints" / "step-00000004"
        step.mkdir(parents=True)
        manifest = {"format": FORMAT, "version": VERSION, "complete": True, "step": 4, "tensors": {}, "files": {}}
        (step / MANIFEST).write_text(json.dumps(manifest))
    return run


def test_generate_run_trained_without_final_checkpoint(tmp_path, capsys):
    run = _run_without_final(tmp_path, save_final=False, checkpoint=True)
    err = _fails(capsys, ["generate", "--run", str(run)])
    assert "checkpoint.save_final=false" in err and "did it finish" not in err
    assert f"plait convert {run / 'checkpoints'} DIR" in err and "plait generate --hf DIR" in err
    assert "step-00000004" in err


def test_generate_run_that_did_not_finish(tmp_path, capsys):
    run = _run_without_final(tmp_path, save_final=True, checkpoint=False)
    err = _fails(capsys, ["generate", "--run", str(run)])
    assert "did it finish" in err and "no complete training checkpoint" in err and "save_final" not in err


class _Pieces(io.StringIO):
    """A stdout that records each write."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return super().write(text)


def test_generate_streams_the_text_and_stops_at_a_stop_string(hf_dir, capsys, monkeypatch):
    from plait.cli import main

    argv = ["generate", "--hf", str(hf_dir), "--prompt", "to be", "--max-new-tokens", "24", "--greedy"]
    assert main(argv + ["--no-stream"]) == 0
    plain = capsys.readouterr()
    assert plain.err == "" and plain.out.startswith("to be")
    out = _Pieces()
    monkeypatch.setattr("sys.stdout", out)
    assert main(argv) == 0
    assert out.getvalue() == plain.out  # streamed, the text is the same
    assert len([p for p in out.pieces if p.strip()]) > 3  # and it came in pieces, as the tokens did
    monkeypatch.undo()
    text = plain.out[len("to be"):].rstrip("\n")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert main(argv + ["--stop", stop]) == 0
    cut = capsys.readouterr().out
    assert cut == "to be" + text[:text.find(stop)] + "\n"
    assert main(argv + ["--stop", stop, "--no-stream"]) == 0
    assert capsys.readouterr().out == cut
    assert main(argv + ["--stop", ""]) == 2
    assert "--stop ''" in capsys.readouterr().err


# ------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("argv,needle", [
    (["--memory", "nan"], "--memory=nan"),
    (["--memory", "inf"], "--memory=inf"),
    (["--memory", "-5"], "--memory=-5.0"),
    (["--headroom", "nan"], "--headroom=nan"),
    (["--nodes-of", "0"], "--nodes-of=0 must be a positive integer"),
    (["--nodes-of", "-2"], "--nodes-of=-2 must be a positive integer"),
    (["--global-batch", "0"], "--global-batch=0 must be a positive integer"),
])
def test_plan_rejects_unusable_option_values(capsys, argv, needle):
    err = _fails(capsys, ["plan", str(RECIPES / "default.yaml"), "--world", "2", *argv])
    assert err.startswith("plait plan: ") and needle in err


@pytest.fixture
def measured_cpu(tmp_path, monkeypatch):
    """A fixed CPU peak in a private cache, so planning on cpu neither probes nor writes the user's cache."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("plait.devices.measure_matmul_flops", lambda dtype, **kw: 50e9)


@pytest.mark.parametrize("nodes_of", [None, "1"])
def test_plan_cpu_prices_worlds_above_one(capsys, measured_cpu, nodes_of):
    from plait.cli import main

    argv = ["plan", str(RECIPES / "default.yaml"), "--world", "4", "--device", "cpu", "--all"]
    if nodes_of:
        argv += ["--nodes-of", nodes_of]  # one rank per host: the ranks talk over the network
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 4 x cpu" in out and "recommended: tp" in out
    assert ("4 per node" if nodes_of is None else "1 per node") in out
    if nodes_of is None:
        assert "tp2 " in out  # ranks sharing this host may use tensor parallelism


def test_cpu_bandwidths_price_data_parallel_reduction():
    from plait.devices import CPU_LOOPBACK_BW, CPU_NETWORK_BW, get_device
    from plait.models.llama import LlamaConfig
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.timing import estimate_step_time

    spec = get_device("cpu")
    assert spec.intra_node_bw == 2 * CPU_LOOPBACK_BW and spec.inter_node_bw == CPU_NETWORK_BW
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    kw = dict(micro_batch_size=1, seq_len=32, microbatches=1, peak=1e9)
    layout = ParallelDegrees(tp=1, pp=1, dp=4)
    same_host = estimate_step_time(config, layout, spec, devices_per_node=4, **kw)
    across = estimate_step_time(config, layout, spec, devices_per_node=1, **kw)
    assert 0 < same_host.dp_comm_s and 0 < across.dp_comm_s


def test_plan_help_describes_what_the_trainer_supports(capsys):
    from plait.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "yet" not in text
    assert "parallel.zero" in text and "train.activation_checkpointing" in text
    for preset in ("fp32", "autocast", "bf16-mixed", "bf16-pure"):
        assert preset in text


def test_plan_overrides_select_the_recommended_layout():
    """The printed overrides, applied to the recipe, validate (checkpointing and ZeRO-1 included)."""
    from plait.commands.plan import load_plan_inputs, recipe_overrides
    from plait.config import load_recipe, validate_recipe
    from plait.plan.search import SearchOptions, rank_layouts

    recipe, config = load_plan_inputs(str(RECIPES / "default.yaml"), [])
    plan = rank_layouts(config, 4, "h100", devices_per_node=4, micro_batch_size=recipe.data.micro_batch_size,
                        seq_len=recipe.data.seq_len, global_batch_size=recipe.data.global_batch_size,
                        options=SearchOptions(activation_checkpointing=("full",)))
    chosen = next(c for c in plan.candidates if c.layout.zero == 1)
    items = recipe_overrides(chosen).split()
    assert "train.activation_checkpointing=full" in items and "parallel.zero=1" in items
    resolved = validate_recipe(load_recipe(str(RECIPES / "default.yaml"), items).model_dump(), 4, check_paths=False)
    assert resolved.recipe.train.activation_checkpointing == "full" and resolved.recipe.parallel.zero_level() == 1


def test_ctrl_c_outside_training_ends_without_a_traceback(capsys, monkeypatch):
    """A KeyboardInterrupt while a command loads or launches (before any training step has its own
    handler) is one line and status 130, not a traceback."""
    import plait.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(plait.cli, "_run", interrupted)
    assert plait.cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "plait: interrupted"
