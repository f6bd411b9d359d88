"""``plait launch slurm|k8s``: golden launch files, ``bash -n`` on the sbatch script, the recipe
validated before anything is written, and a file plait did not write never replaced."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from plait.cli import main
from plait.config import validate_recipe
from plait.config.load import parse_recipe_text

FIXTURES = Path(__file__).parent / "fixtures" / "launch"
RECIPE = "tests/fixtures/launch/tiny.yaml"  # as a user would type it, from the repository root
ROOT = Path(__file__).parents[1]
SLURM = ["launch", "slurm", RECIPE, "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time",
         "24:00:00", "--iface", "ib0", "optimizer.lr=1e-3"]
K8S = ["launch", "k8s", RECIPE, "--nodes", "4", "--min-nodes", "2", "--gpus-per-node", "8", "--image",
       "ghcr.io/example/plait:1.0", "--pvc", "plait-runs", "--iface", "eth0", "--rdzv-timeout", "900"]
#: set to 1 to rewrite the golden files after an intended change (then review the diff)
REGENERATE = os.environ.get("PLAIT_REGENERATE_GOLDEN") == "1"


def _write(args: list[str], out: Path, monkeypatch) -> int:
    monkeypatch.chdir(ROOT)
    return main([*args, "-o", str(out)])


@pytest.mark.parametrize("args,golden", [(SLURM, "tiny.sbatch"), (K8S, "tiny-pytorchjob.yaml")])
def test_launch_files_match_the_golden_files(args, golden, tmp_path, monkeypatch):
    out = tmp_path / golden
    assert _write(args, out, monkeypatch) == 0
    if REGENERATE:
        shutil.copyfile(out, FIXTURES / golden)
    assert out.read_text() == (FIXTURES / golden).read_text()


def test_the_sbatch_script_is_valid_bash_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "job.sbatch"
    assert _write(SLURM, out, monkeypatch) == 0
    subprocess.run(["bash", "-n", str(out)], check=True)
    text = out.read_text()
    for needle in ("--rdzv-backend=c10d", "--requeue", "--signal=B:USR1@300", "trap stop_and_requeue USR1 TERM",
                   "GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib0", "checkpoint.resume=auto",
                   "--nnodes=2 --nproc-per-node=4"):
        assert needle in text, needle


def test_the_manifest_carries_a_recipe_that_validates(tmp_path, monkeypatch):
    out = tmp_path / "job.yaml"
    assert _write(K8S, out, monkeypatch) == 0
    config_map, job = list(yaml.safe_load_all(out.read_text()))
    recipe = parse_recipe_text(config_map["data"]["recipe.yaml"], "configmap")
    resolved = validate_recipe(recipe, 2 * 8, check_paths=False)  # the elastic job's smallest world
    r = resolved.recipe
    assert (r.checkpoint.resume, r.launch.iface, r.launch.rdzv_timeout_s) == ("auto", "eth0", 900.0)
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["rdzvBackend"]) == (2, 4, "c10d")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4


def test_a_bad_recipe_writes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "job.sbatch"
    assert _write(["launch", "slurm", RECIPE, "--nodes", "1", "--gpus-per-node", "3"], out, monkeypatch) == 2
    assert "parallel.tp" in capsys.readouterr().err and not out.exists()
    assert _write([*K8S[:-6], "parallel.dp=16"], out, monkeypatch) == 2  # right for 4 nodes, not for 2
    err = capsys.readouterr().err
    assert "parallel.dp=16" in err and "parallel.dp=null" in err and not out.exists()


def test_a_file_plait_did_not_write_is_never_replaced(tmp_path, monkeypatch, capsys):
    out = tmp_path / "job.sbatch"
    out.write_text("#!/bin/bash\necho mine\n")
    assert _write(SLURM, out, monkeypatch) == 2
    assert "plait will not replace it" in capsys.readouterr().err
    assert out.read_text() == "#!/bin/bash\necho mine\n"
    (tmp_path / "dir").mkdir()
    assert _write(SLURM, tmp_path / "dir", monkeypatch) == 2
    own = tmp_path / "own.sbatch"
    assert _write(SLURM, own, monkeypatch) == 0
    own.write_text(own.read_text().replace("--time=24:00:00", "--time=1:00:00"))
    assert _write(SLURM, own, monkeypatch) == 0  # plait's own file (marker intact) is replaced
    assert "--time=24:00:00" in own.read_text()
