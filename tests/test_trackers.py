"""W&B and MLflow: metrics read back through each library's own reader, failures that never stop
training, and the problems that are refused before launch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from plait.config import RecipeError, load_recipe, validate_recipe
from plait.config.load import DEFAULT_RECIPE
from plait.tracking.background import BackgroundTracker
from plait.tracking.mlflow_run import flat_params

PLAIT = str(Path(sys.executable).parent / "plait")
WANDB = str(Path(sys.executable).parent / "wandb")
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
         "parallel.sequence_parallel=false", "parallel.tp=1", "data.micro_batch_size=4",
         "scheduler.warmup_steps=0", "logging.progress_bar=false", "train.log_every=1", "train.eval_every=2",
         "train.eval_batches=1", "train.sample_tokens=0", "logging.plot=false", "checkpoint.async_save=false"]


def _train(tmp_path, items: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [PLAIT, "train", "--nproc", "2", "parallel.dp=2", f"data.cache_dir={tmp_path / 'cache'}",
           f"run.output_dir={tmp_path / 'run'}", *SMALL, *items]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, **(env or {})})


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_records(run_file: Path) -> list[dict]:
    """The records of a ``.wandb`` transaction log, through W&B's own reader (``wandb leet inspect``)."""
    out = subprocess.run([WANDB, "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# ------------------------------------------------------------------------------ end to end
def test_the_tracker_sinks_of_a_recipe_send_grouped_metrics_and_the_resolved_recipe(tmp_path, monkeypatch):
    """The sinks ``build_run`` makes, fed records directly (the two-rank training run below is slow)."""
    from mlflow import MlflowClient

    from plait.train.trackers import tracker_sinks

    store = tmp_path / "mlstore"
    resolved = validate_recipe(load_recipe(DEFAULT_RECIPE, [
        f"run.output_dir={tmp_path / 'run'}", "logging.wandb={project: quick, mode: offline}",
        f"logging.mlflow.tracking_uri={store.as_uri()}", "parallel.tp=1", "parallel.sequence_parallel=false"]), 1)
    out = io.StringIO()
    sinks = tracker_sinks(resolved, 0, stream=out)
    assert [s.label for s in sinks] == ["W&B", "MLflow"]
    for step in (1, 2):
        for sink in sinks:
            sink.log(step, {"loss": 3.0 / step, "tokens_per_s": 100.0 * step, "val_loss/web": 2.5})
    for sink in sinks:
        sink.close()
    assert "warning" not in out.getvalue() and out.getvalue().count("started") == 2
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    history = [rec["history"] for rec in records if rec["type"] == "history"]
    assert [(h["step"]["num"], h["item"]["train/loss"], h["item"]["perf/tokens_per_s"], h["item"]["val/loss/web"])
            for h in history] == [(1, 3.0, 100.0, 2.5), (2, 1.5, 200.0, 2.5)]
    header = next(rec["run"] for rec in records if rec["type"] == "run")
    assert header["project"] == "quick" and header["config"]["update"]["parallel"]["tp"] == 1
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("plait").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "perf/tokens_per_s")] == [
        (1, 100.0), (2, 200.0)]
    assert run.data.params["data.seq_len"] == "128" and run.info.status == "FINISHED"


@pytest.mark.slow  # two training runs of two ranks (30 s); the test above covers the sinks alone
def test_wandb_and_mlflow_get_every_metric_and_the_recipe_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    store = tmp_path / "mlstore"
    trackers = ["logging.wandb={project: plait-test, tags: [ci, tiny], mode: offline}",
                f"logging.mlflow={{tracking_uri: {store.as_uri()}, experiment: trackers}}",
                "checkpoint.save_every=2"]
    first = _train(tmp_path, trackers + ["train.steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(tmp_path, trackers + ["train.steps=4", "checkpoint.resume=auto"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "warning" not in first.stderr + second.stderr
    run_dir = tmp_path / "run"
    jsonl = {r["step"]: r for r in _jsonl(run_dir)}
    assert sorted(jsonl) == [1, 2, 3, 4]

    # W&B: one offline run per attempt, both of the same W&B run id (the resume continues it)
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # rank 1 logs nothing
    runs = [_wandb_records(f) for f in files]
    ids = {rec["run"]["run_id"] for records in runs for rec in records if rec["type"] == "run"}
    assert len(ids) == 1
    header = next(rec["run"] for rec in runs[0] if rec["type"] == "run")
    assert header["project"] == "plait-test" and header["tags"] == ["ci", "tiny"]
    assert header["display_name"] == "shakespeare-tiny"
    config = header["config"]["update"]
    assert config["parallel"]["dp"] == 2 and config["train"]["steps"] == 2 and config["world_size"] == 2
    assert config["logging"]["wandb"]["project"] == "plait-test"
    history = {rec["history"]["step"]["num"]: rec["history"]["item"]
               for records in runs for rec in records if rec["type"] == "history"}
    assert sorted(history) == [1, 2, 3, 4]
    for step, record in jsonl.items():
        assert history[step]["train/loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert history[step]["train/lr"] == pytest.approx(record["lr"], rel=1e-12)
        assert history[step]["perf/tokens_per_s"] == pytest.approx(record["tokens_per_s"], rel=1e-12)
    assert [s for s in history if "val/loss" in history[s]] == [2, 4]
    assert history[4]["val/loss"] == pytest.approx(jsonl[4]["val_loss"], rel=1e-12)
    assert not any(key.startswith(("loss", "val_")) for item in history.values() for key in item)

    # MLflow: one run, continued, with the metric history of all four steps
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name("trackers")
    found = client.search_runs([experiment.experiment_id])
    assert len(found) == 1
    run = client.get_run(found[0].info.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "shakespeare-tiny"
    assert run.data.tags["plait.resumed_at_step"] == "2"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(s, pytest.approx(jsonl[s]["loss"], rel=1e-12)) for s in range(1, 5)]
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert [m.step for m in val] == [2, 4] and val[1].value == pytest.approx(jsonl[4]["val_loss"], rel=1e-12)
    assert run.data.params["parallel.dp"] == "2" and run.data.params["train.steps"] == "2"
    assert run.data.params["world_size"] == "2"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"recipe.yaml", "recipe-step-2.yaml"}
    (tmp_path / "dl").mkdir()
    resumed = Path(client.download_artifacts(run.info.run_id, "recipe-step-2.yaml", str(tmp_path / "dl")))
    assert "steps: 4" in resumed.read_text() and resumed.read_text().startswith("# resolved recipe of this run")


def test_an_mlflow_server_that_answers_with_errors_warns_once_and_logging_never_raises(tmp_path, monkeypatch):
    """The real MLflow client against a server that accepts connections and fails every call."""
    from plait.tracking.mlflow_run import open_mlflow_run
    from plait.tracking.settings import MlflowSettings

    requests: list[str] = []

    class Broken(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_error(500, "store offline")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = io.StringIO()
    settings = MlflowSettings(tracking_uri=f"http://127.0.0.1:{server.server_port}")
    try:
        sink = BackgroundTracker("MLflow", lambda: open_mlflow_run(
            settings, run_name="r", run_dir=tmp_path, config={"run": {"name": "r"}}, recipe_yaml="run: {}\n",
            start_step=0, stream=out), stream=out)
        for step in range(1, 4):
            sink.log(step, {"loss": 1.0})
        sink.close()
    finally:
        server.shutdown()
    warnings = out.getvalue().splitlines()
    assert len(warnings) == 1 and "MLflow logging could not start" in warnings[0], warnings
    assert "500" in warnings[0] and "training goes on without it" in warnings[0]
    assert requests  # the client did reach the server


# ------------------------------------------------------------------------------ the background thread
class _Client:
    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None):
        self.logged: list[tuple[int, dict]] = []
        self.closed = False
        self.fail_at, self.gate = fail_at, gate

    def log(self, step, scalars):
        if self.gate is not None:
            self.gate.wait(10)
        if step == self.fail_at:
            raise ConnectionError("server went away")
        self.logged.append((step, scalars))

    def close(self):
        self.closed = True


def test_a_failing_tracker_warns_once_and_drops_the_rest():
    client, out = _Client(fail_at=2), io.StringIO()
    sink = BackgroundTracker("MLflow", lambda: client, stream=out)
    for step in range(1, 6):
        sink.log(step, {"loss": 1.0 / step, "val_loss/web": 2.0, "tokens_per_s": 10.0, "note": "skipped"})
    sink.flush()
    assert sink.failed
    sink.close()
    assert client.logged == [(1, {"train/loss": 1.0, "val/loss/web": 2.0, "perf/tokens_per_s": 10.0})]
    assert client.closed
    lines = out.getvalue().splitlines()
    assert lines == ["plait: warning: MLflow logging failed at step 2 (ConnectionError: server went away); "
                     "training goes on without it"]


def test_a_tracker_that_cannot_start_warns_once_and_close_returns():
    out = io.StringIO()

    def refuse():
        raise PermissionError("no access to project")

    sink = BackgroundTracker("W&B", refuse, stream=out)
    for step in range(1, 4):
        sink.log(step, {"loss": 1.0})
    sink.flush()
    sink.close()
    assert out.getvalue().splitlines() == ["plait: warning: W&B logging could not start (PermissionError: no access "
                                           "to project); training goes on without it"]


def test_a_slow_tracker_never_blocks_logging_and_a_dead_one_does_not_hold_the_close():
    gate, out = threading.Event(), io.StringIO()
    client = _Client(gate=gate)
    sink = BackgroundTracker("W&B", lambda: client, queue_size=2, close_timeout_s=0.5, stream=out)
    start = time.perf_counter()
    for step in range(1, 50):
        sink.log(step, {"loss": 1.0})
    assert time.perf_counter() - start < 1.0  # the step never waits for the server
    sink.close()  # the client is still stuck in its first call
    text = out.getvalue()
    assert text.count("falls behind") == 1 and text.count("did not finish sending within 0.5 s") == 1
    gate.set()


def test_flat_params_are_section_dot_field():
    params = dict(flat_params({"parallel": {"tp": 2, "pipeline_cuts": None}, "model": {"rope_scaling": {"f": 8}},
                               "world_size": 4, "run": {"name": "x" * 7000}}))
    assert params["parallel.tp"] == "2" and params["parallel.pipeline_cuts"] == "null"
    assert params["model.rope_scaling"] == '{"f": 8}' and params["world_size"] == "4"
    assert len(params["run.name"]) == 6000


# ------------------------------------------------------------------------------ before launch
def _problems(items: list[str], **kwargs) -> str:
    with pytest.raises(RecipeError) as e:
        validate_recipe(load_recipe(DEFAULT_RECIPE, items), **kwargs)
    return str(e.value)


def test_tracker_problems_are_one_line_each_before_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    text = _problems(["logging.wandb.project=p"])
    assert "logging.wandb.mode" in text and "needs a W&B API key" in text and "mode=offline" in text
    assert "ftp" in _problems(["logging.mlflow.tracking_uri=ftp://host/x"])
    assert "three slashes" in _problems(["logging.mlflow.tracking_uri=file://tmp/mlruns"])
    (tmp_path / "a-file").write_text("x")
    assert "is a file" in _problems([f"logging.mlflow.tracking_uri={(tmp_path / 'a-file').as_uri()}"])
    assert "is a file" in _problems(["logging.wandb.mode=offline", f"logging.wandb.dir={tmp_path / 'a-file' / 'w'}"])
    closed = _closed_port()
    assert f"nothing answers at 127.0.0.1:{closed}" in _problems([f"logging.mlflow.tracking_uri=http://127.0.0.1:"
                                                                   f"{closed}"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "gopher://x")
    assert "$MLFLOW_TRACKING_URI" in _problems(["logging.mlflow.experiment=e"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert "logging.wandb.projct" in _problems(["logging.wandb.projct=p"])
    # a recipe meant for another machine: only the form of the URI is checked
    validate_recipe(load_recipe(DEFAULT_RECIPE, ["logging.wandb.project=p", "logging.mlflow.tracking_uri="
                                                 f"http://127.0.0.1:{closed}"]), check_paths=False)
    monkeypatch.setattr("plait.config.rules.trackers.installed", lambda module: False)
    assert "W&B is not installed here" in _problems(["logging.wandb.mode=offline"])
    assert "MLflow is not installed here" in _problems(["logging.mlflow.experiment=e"])


def test_an_online_wandb_run_without_a_key_is_refused_by_plait_train_before_any_process_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env["NETRC"] = str(tmp_path / "no-netrc")
    done = subprocess.run([PLAIT, "train", "logging.wandb.project=p", f"run.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "logging.wandb.mode" in done.stderr and "launching" not in done.stdout + done.stderr
    assert not (tmp_path / "run").exists()


def test_tracker_overrides_keep_text_as_text():
    recipe = load_recipe(DEFAULT_RECIPE, ["logging.wandb.name=1e3", "logging.wandb.tags=[a, b]",
                                          "logging.mlflow.run_name=007"])
    assert recipe.logging.wandb.name == "1e3" and recipe.logging.wandb.tags == ["a", "b"]
    assert recipe.logging.mlflow.run_name == "007" and recipe.logging.wandb.project == "plait"
    assert load_recipe(DEFAULT_RECIPE, ["logging.wandb={mode: offline}", "logging.wandb=null"]).logging.wandb is None


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tracker_settings_mistakes_name_the_field_and_the_fix():
    assert "did you mean 'project'?" in _problems(["logging.wandb.projct=p"])
    text = _problems(["logging.wandb=offline"])
    assert "logging.wandb: 'offline'" in text and "fields: project, entity, name, tags, mode, dir" in text
    assert "must be a list" in _problems(["logging.wandb.tags=x"])
    assert "must be one of 'online', 'offline' or 'disabled'" in _problems(["logging.wandb.mode=offlin"])
