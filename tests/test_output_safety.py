"""plait never deletes or replaces what it did not create; one run per directory; unwritable
output directories are found before launch.

Each test builds the situation a user met (a folder of their own models as the target, a run
directory as a conversion target, two runs on one directory, a killed holder, an unwritable
save directory) and checks both the refusal message and that every file is still there.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import build_llama
from plait.checkpoint.convert import hf_to_plait, plait_to_hf
from plait.checkpoint.preflight import check_outputs, claim_outputs
from plait.cli import main
from plait.config import validate_recipe
from plait.mesh import single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.models.llama.config import LlamaConfig
from plait.outputs import DirectoryLock, DirectoryLockedError, OutputDirError
from plait.outputs.ownership import MARKER, classify

TINY = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what must survive a refused write)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _user_folder(path: Path) -> Path:
    """A folder of the user's own: models and notes plait never wrote."""
    (path / "llama-7b").mkdir(parents=True)
    (path / "llama-7b" / "config.json").write_text('{"model_type": "llama"}')
    (path / "notes.txt").write_text("my notes")
    return path


def _hf_model(path: Path) -> Path:
    model = build_llama(TINY, single_process_mesh())
    save_hf_checkpoint(model, path, single_process_mesh().info("tp"))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory as plait train leaves it: a checkpoint, metrics and the recipe."""
    run = tmp_path_factory.mktemp("run")
    hf = _hf_model(tmp_path_factory.mktemp("src") / "hf")
    hf_to_plait(hf, run / "checkpoints", progress=False)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "recipe.yaml").write_text("# resolved recipe of this run\nrun: {}\n")
    return run


# ------------------------------------------------------------------ item 1: never replace foreign files
def test_hf_writer_refuses_a_folder_it_did_not_write(tmp_path):
    target = _user_folder(tmp_path / "models")
    before = _snapshot(target)
    model = build_llama(TINY, single_process_mesh())
    for replace in (False, True):  # not even when replacing is allowed: only plait's own models are replaced
        with pytest.raises(OutputDirError, match="not written by plait"):
            save_hf_checkpoint(model, target, single_process_mesh().info("tp"), replace=replace)
    assert _snapshot(target) == before


def test_hf_writer_replaces_its_own_model_only_when_allowed(tmp_path):
    target = _hf_model(tmp_path / "hf")
    assert classify(target, "hf-model") == "ours" and (target / MARKER).is_file()
    model = build_llama(TINY, single_process_mesh(), seed=1)
    with pytest.raises(OutputDirError, match="already holds a Hugging Face model written by plait"):
        save_hf_checkpoint(model, target, single_process_mesh().info("tp"))
    save_hf_checkpoint(model, target, single_process_mesh().info("tp"), replace=True)
    assert (target / "config.json").is_file()


def test_convert_into_the_run_directory_is_refused_and_keeps_it(run_dir, capsys):
    before = _snapshot(run_dir)
    assert main(["convert", str(run_dir / "checkpoints"), str(run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "contains the source" in err and str(run_dir) in err
    assert main(["convert", str(run_dir / "checkpoints"), str(run_dir), "--no-progress", "--overwrite"]) == 2
    assert _snapshot(run_dir) == before


def test_convert_into_a_user_folder_is_refused(run_dir, tmp_path, capsys):
    target = _user_folder(tmp_path / "models")
    before = _snapshot(target)
    assert main(["convert", str(run_dir / "checkpoints"), str(target), "--no-progress", "--overwrite"]) == 2
    assert "not written by plait" in capsys.readouterr().err
    assert _snapshot(target) == before


def test_convert_replaces_a_previous_conversion_only_with_overwrite(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["convert", str(run_dir / "checkpoints"), str(out), "--no-progress"]) == 0
    assert main(["convert", str(run_dir / "checkpoints"), str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", str(run_dir / "checkpoints"), str(out), "--no-progress", "--overwrite"]) == 0


def test_hf_to_plait_refuses_a_foreign_folder_and_an_existing_step(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    target = _user_folder(tmp_path / "models")
    before = _snapshot(target)
    with pytest.raises(OutputDirError, match="not written by plait"):
        hf_to_plait(hf, target, progress=False)
    assert _snapshot(target) == before
    hf_to_plait(hf, tmp_path / "ckpt", progress=False)
    with pytest.raises(OutputDirError, match="--overwrite"):
        hf_to_plait(hf, tmp_path / "ckpt", progress=False)
    hf_to_plait(hf, tmp_path / "ckpt", progress=False, overwrite=True)


def test_plait_to_hf_refuses_a_target_containing_the_checkpoint(run_dir):
    with pytest.raises(OutputDirError, match="contains the source checkpoint"):
        plait_to_hf(run_dir / "checkpoints" / "step-00000000", run_dir, progress=False, overwrite=True)


# ------------------------------------------------------------------ item 1 through the recipe
def _resolved(tmp_path: Path, *items: str):
    data = {"run": {"output_dir": str(tmp_path / "run")}, "train": {"steps": 40},
            "parallel": {"tp": 1, "sequence_parallel": False}}
    for item in items:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        data.setdefault(section, {})[field] = value if not value.isdigit() else int(value)
        if value in ("true", "false"):
            data[section][field] = value == "true"
    return validate_recipe(data, 1)


@pytest.mark.parametrize("setting", ["checkpoint.dir", "checkpoint.save_dir", "run.output_dir"])
def test_recipe_pointing_at_a_user_folder_is_refused(tmp_path, setting):
    target = _user_folder(tmp_path / "models")
    with pytest.raises(OutputDirError, match=f"{setting}=.*not written by plait"):
        check_outputs(_resolved(tmp_path, f"{setting}={target}"))


@pytest.mark.parametrize("final", ["{output_dir}", "{output_dir}/checkpoints", "{output_dir}/.."])
def test_final_model_directory_may_not_contain_the_run(tmp_path, final):
    with pytest.raises(OutputDirError, match="checkpoint.dir=.* contains"):
        check_outputs(_resolved(tmp_path, f"checkpoint.dir={final}"))


def test_final_model_may_not_replace_the_model_it_starts_from(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    (hf / "tokenizer.json").write_text("{}")
    resolved = _resolved(tmp_path, f"checkpoint.dir={hf}", "checkpoint.overwrite=true")
    object.__setattr__(resolved.recipe.model, "hf_path", str(hf))  # the architecture check is not under test
    with pytest.raises(OutputDirError, match="checkpoint.dir=.* is model.hf_path .* which this command reads"):
        check_outputs(resolved)


def test_a_rerun_reuses_its_own_directory_but_another_runs_model_needs_overwrite(tmp_path):
    resolved = _resolved(tmp_path)
    for lock in claim_outputs(resolved):
        lock.release()
    _hf_model(Path(resolved.checkpoint_dir))
    check_outputs(resolved)  # the same run again: its own final model may be replaced
    other = _resolved(tmp_path / "b", f"checkpoint.dir={resolved.checkpoint_dir}")
    with pytest.raises(OutputDirError, match="checkpoint.overwrite=true"):
        check_outputs(other)
    check_outputs(_resolved(tmp_path / "b", f"checkpoint.dir={resolved.checkpoint_dir}", "checkpoint.overwrite=true"))


def test_plait_train_refuses_a_user_folder_before_launch(tmp_path, capsys):
    target = _user_folder(tmp_path / "models")
    before = _snapshot(target)
    code = main(["train", f"run.output_dir={tmp_path / 'run'}", f"checkpoint.dir={target}", "--nproc", "2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "checkpoint.dir=" in err and "not written by plait" in err
    assert _snapshot(target) == before
    assert not (tmp_path / "run").exists(), "nothing is created when the recipe is refused"


# ------------------------------------------------------------------ item 2: one run per directory
_HOLDER = """
import sys, time
from plait.outputs import DirectoryLock
DirectoryLock(sys.argv[1], what="run.output_dir").acquire()
print("held", flush=True)
time.sleep(120)
"""


def _hold(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path, capsys):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        with pytest.raises(DirectoryLockedError, match=rf"host {socket.gethostname()}, PID {holder.pid}"):
            DirectoryLock(out, what="run.output_dir").acquire()
        code = main(["train", f"run.output_dir={out}", "parallel.tp=1", "parallel.sequence_parallel=false"])
        assert code == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # the worst moment: no clean-up runs
        holder.wait()
    with DirectoryLock(out, what="run.output_dir"):  # the lock died with its holder
        pass


def test_the_save_directory_is_locked_too(tmp_path):
    resolved = _resolved(tmp_path, f"checkpoint.save_dir={tmp_path / 'shared-ckpts'}")
    holder = _hold(tmp_path / "shared-ckpts")
    try:
        with pytest.raises(DirectoryLockedError, match="checkpoint.save_dir="):
            claim_outputs(resolved)
        # the output directory's lock was released again: all or none
        with DirectoryLock(resolved.output_dir, what="run.output_dir"):
            pass
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ item 3: unwritable directories
def test_unwritable_save_directory_is_found_before_launch(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    save = blocker / "checkpoints"
    with pytest.raises(OutputDirError, match="checkpoint.save_dir=.*cannot be written"):
        claim_outputs(_resolved(tmp_path, f"checkpoint.save_dir={save}"))
    start = time.monotonic()
    assert main(["train", f"run.output_dir={tmp_path / 'run'}", f"checkpoint.save_dir={save}", "--nproc", "2"]) == 2
    assert "checkpoint.save_dir=" in capsys.readouterr().err
    assert time.monotonic() - start < 30, "refused before any data preparation or launch"


@pytest.mark.skipif(os.path.exists("/proc/self") is False, reason="needs /proc (a read-only file system)")
def test_read_only_file_system_is_found_before_launch(tmp_path):
    with pytest.raises(OutputDirError, match="run.output_dir=.*cannot be written"):
        claim_outputs(_resolved(tmp_path, "run.output_dir=/proc/plait-run"))


def test_final_model_parent_is_probed(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputDirError, match="checkpoint.dir=.*cannot be written"):
        claim_outputs(_resolved(tmp_path, f"checkpoint.dir={blocker / 'final'}"))


# ------------------------------------------------------------------ shared directories: readable outputs
def test_written_models_and_checkpoints_follow_the_umask(tmp_path):
    """safetensors writes 0600 files and mkdtemp 0700 directories; with umask 022 a colleague must
    be able to read what plait wrote."""
    old = os.umask(0o022)
    try:
        hf = _hf_model(tmp_path / "hf")
        ckpt = hf_to_plait(hf, tmp_path / "ckpt", progress=False)
    finally:
        os.umask(old)
    assert hf.stat().st_mode & 0o777 == 0o755
    for f in [*hf.iterdir(), *ckpt.glob("*.safetensors")]:
        assert f.stat().st_mode & 0o777 == 0o644, f


# ------------------------------------------------------------------ item 9 through plait train
def test_damaged_prepared_data_is_one_line_from_plait_train(tmp_path, monkeypatch, capsys):
    """A truncated shard is found by plait train before launch, reported as one line naming the file,
    and the run's directory locks are released again (a later run in-process is not refused)."""
    from plait.config import load_recipe
    from plait.train.entry import prepare_data

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"text": "Record {i}: a small brown dog runs home to eat {i} apples."}}\n'
                           for i in range(200)))
    items = [f"data.source={src}", "data.vocab_size=300", "data.seq_len=16", "parallel.tp=1",
             "parallel.sequence_parallel=false", "model.max_position_embeddings=16"]
    prepared = prepare_data(load_recipe(None, items))
    shard = prepared / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-3])
    args = ["train", *items, f"run.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train-00000.bin" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with DirectoryLock(tmp_path / "run", what="run.output_dir"):
        pass


def test_config_validate_applies_the_output_rules(tmp_path, capsys):
    target = _user_folder(tmp_path / "models")
    assert main(["config", "validate", f"run.output_dir={tmp_path / 'run'}", f"checkpoint.dir={target}"]) == 2
    assert "checkpoint.dir=" in capsys.readouterr().err
    assert main(["config", "validate", f"run.output_dir={tmp_path / 'new'}"]) == 0
    assert not (tmp_path / "new").exists(), "validate only reads"


# ------------------------------------------------------------------ found by trying it as a new user
def test_convert_dest_inside_the_source_or_unwritable_is_one_line(run_dir, tmp_path, capsys):
    before = _snapshot(run_dir)
    inside = run_dir / "checkpoints" / "step-00000000" / "sub"
    assert main(["convert", str(run_dir / "checkpoints"), str(inside), "--no-progress"]) == 2
    assert "inside the source" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["convert", str(run_dir / "checkpoints"), str(blocker / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "DEST=" in err and "cannot be written" in err and "Traceback" not in err
    assert _snapshot(run_dir) == before


def test_a_fresh_run_does_not_train_over_an_earlier_runs_checkpoints(run_dir, tmp_path):
    """resume=none over checkpoints would let retention delete them: continue, overwrite or move."""
    data = {"run": {"output_dir": str(run_dir)}, "train": {"steps": 40},
            "parallel": {"tp": 1, "sequence_parallel": False}}
    with pytest.raises(OutputDirError, match="checkpoints of an earlier run.*resume=auto"):
        check_outputs(validate_recipe(data, 1))
    check_outputs(validate_recipe({**data, "checkpoint": {"resume": "auto"}}, 1))
    check_outputs(validate_recipe({**data, "checkpoint": {"overwrite": True}}, 1))


def test_home_directory_is_expanded_in_output_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    resolved = _resolved(tmp_path, "run.output_dir=~/runs/x")
    assert resolved.output_dir == str(tmp_path / "runs" / "x")
    assert resolved.save_dir.startswith(str(tmp_path))


def test_the_probe_names_the_setting_value(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputDirError, match=rf"checkpoint.dir={blocker / 'final'} cannot be written"):
        claim_outputs(_resolved(tmp_path, f"checkpoint.dir={blocker / 'final'}"))


_ORPHAN = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import time
from plait.launch import exit_when_orphaned
exit_when_orphaned(grace_s=1.0, poll_s=0.1)
print("ready", flush=True)
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_worker_ends_when_its_launcher_is_killed(tmp_path):
    """kill -9 of plait train during start-up left its workers waiting forever (re-parented)."""
    launcher = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state == "Z":  # ended; only waiting for a parent (PID 1 here) to reap it
            return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the orphaned worker did not end")


def test_a_data_error_met_by_a_worker_is_one_line(tmp_path):
    """Token ids past the vocabulary in a shard whose index says otherwise are found when a batch
    is drawn, inside the workers: each says so in one line and plait train exits 2, without the
    launcher's tracebacks."""
    import json

    import numpy as np

    from plait.config import load_recipe
    from plait.train.entry import prepare_data

    env = {**os.environ, "PLAIT_CACHE": str(tmp_path / "cache")}
    os.environ["PLAIT_CACHE"] = env["PLAIT_CACHE"]
    try:
        src = tmp_path / "docs.jsonl"
        src.write_text("".join(f'{{"text": "Record {i}: a small brown dog runs home to eat {i} apples."}}\n'
                               for i in range(400)))
        items = [f"data.source={src}", "data.vocab_size=300", "data.seq_len=16", "parallel.tp=1",
                 "parallel.sequence_parallel=false", "model.max_position_embeddings=16", "model.hidden_size=32",
                 "model.intermediate_size=64", "model.num_hidden_layers=1", "data.micro_batch_size=4"]
        prepared = prepare_data(load_recipe(None, items))
    finally:
        del os.environ["PLAIT_CACHE"]
    dtype = json.loads((prepared / "index.json").read_text()).get("dtype", "uint16")
    shard = np.memmap(prepared / "train-00000.bin", dtype=np.dtype(dtype), mode="r+")
    shard[::7] = 5000
    shard.flush()
    cmd = [sys.executable, "-m", "plait.cli", "train", *items, f"run.output_dir={tmp_path / 'run'}", "train.steps=2",
           "scheduler.warmup_steps=1", "logging.progress_bar=false", "--nproc", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "token id 5000" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "rank 0 (exit status 2)" in proc.stderr or "rank 1 (exit status 2)" in proc.stderr


def test_a_folder_of_a_users_own_run_files_is_not_a_run(tmp_path):
    """Only names a run writes, but no recipe plait wrote: the user's metrics.jsonl is not replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"my": "metrics"}\n')
    assert classify(mine, "run") == "foreign"
    (mine / "recipe.yaml").write_text("run: {}\n")  # a recipe of the user's own, without plait's header
    assert classify(mine, "run") == "foreign"
    (mine / "recipe.yaml").write_text("# resolved recipe of this run\nrun: {}\n")
    assert classify(mine, "run") == "ours"


def test_a_run_refused_after_the_claim_leaves_nothing_in_a_users_folder(tmp_path, capsys):
    """A user's existing empty folder as run.output_dir, a run refused for its data after the
    directories were claimed: the folder keeps neither plait's marker nor its lock file."""
    from chat_task import task_with_tokenizer

    root, paths = task_with_tokenizer(tmp_path / "task", seed=1, train=8, heldout=2)
    mine = tmp_path / "mine"
    mine.mkdir()
    argv = ["train", f"run.output_dir={mine}", "data.format=prompts", "train.objective=grpo",
            f"data.source={paths['prompts_train']}", f"data.tokenizer={root / 'tokenizer.json'}", "data.seq_len=24",
            "grpo.max_new_tokens=4", "grpo.group_size=2", "data.micro_batch_size=2", "parallel.tp=1",
            "parallel.sequence_parallel=false", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2",
            "scheduler.warmup_steps=0"]
    assert main(argv) == 2
    assert "seq_len" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == []
    assert classify(mine, "run") == "empty"


def test_a_folder_of_empty_folders_counts_as_empty(tmp_path):
    """On a shared file system another host's ranks create the run's (empty) checkpoint folder
    before global rank 0 claims the output directory: that must not make it 'not written by plait'.
    A folder with anything in its subfolders is still refused."""
    from plait.outputs.ownership import classify

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert classify(tmp_path / "run", "run") == "empty"
    (tmp_path / "run" / "checkpoints" / "notes.txt").write_text("mine")
    assert classify(tmp_path / "run", "run") == "foreign"
