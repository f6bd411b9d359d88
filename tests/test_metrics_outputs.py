"""Device table and CPU probe cache, FLOPs/MFU arithmetic, metric sinks, plots and the run summary."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch


def _config(**kw):
    from plait.models.llama import LlamaConfig

    base = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


# ------------------------------------------------------------------------------------ FLOPs / MFU
@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_by_hand(tied):
    from plait.models.flops import matmul_params, model_flops_per_token

    cfg = _config(tie_word_embeddings=tied)
    # per layer: q 16*16 + k 16*8 + v 16*8 + o 16*16 = 768; mlp 3*16*32 = 1536; 2 norms 32 -> 2336
    # N = 2 layers * 2336 + final norm 16 + head 100*16 (counted even when tied) = 6288
    assert matmul_params(cfg) == 6288
    assert cfg.num_parameters() == (6288 if tied else 6288 + 1600)
    # 6 N + 12 * layers * heads * head_dim * seq = 37728 + 12*2*4*4*8 = 37728 + 3072
    assert model_flops_per_token(cfg, 8) == 40800
    assert model_flops_per_token(cfg, 16) == 37728 + 6144


def test_flops_counts_biases_and_rejects_bad_seq_len():
    from plait.models.flops import matmul_params, model_flops_per_token

    cfg = _config(attention_bias=True, mlp_bias=True)
    # + q/k/v biases 16+8+8 and o bias 16 = 48, + mlp biases 2*32 + 16 = 80 per layer
    assert matmul_params(cfg) == 6288 + 2 * (48 + 80)
    with pytest.raises(ValueError, match="seq_len"):
        model_flops_per_token(cfg, 0)


def test_moe_flops_count_the_experts_a_token_uses():
    """Mixtral with E experts, top-k: N is the dense model whose MLP is k experts wide, plus the
    routers (E x hidden per layer); the other E - k experts do no work for the token."""
    from plait.models.flops import matmul_params
    from plait.models.mixtral.config import MixtralConfig

    base = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    moe = MixtralConfig(**base, num_local_experts=8, num_experts_per_tok=2)
    dense_k_wide = _config(intermediate_size=2 * 32)
    assert matmul_params(moe) == matmul_params(dense_k_wide) + 2 * 8 * 16
    assert moe.num_parameters() > matmul_params(moe) + 2 * 6 * 3 * 16 * 32 - 1  # every expert is stored


def test_mfu_arithmetic():
    from plait.models.flops import mfu

    assert mfu(1000.0, 40800.0, 1e8) == pytest.approx(0.408)
    # 7B-ish example: 3000 tok/s/GPU * 6*7e9 FLOP/token on an H100's 989.4 TFLOP/s bf16 peak
    assert mfu(3000.0, 6 * 7e9, 989.4e12) == pytest.approx(0.12735, rel=1e-4)
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)


# ------------------------------------------------------------------------------------ devices
def test_device_table_values_and_lookup():
    from plait.devices import DEVICES, DeviceError, get_device, peak_flops

    assert peak_flops("h100", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("H100-SXM", torch.float32) == pytest.approx(67e12)
    assert peak_flops("h200", "bfloat16") == peak_flops("h100", "bf16")
    assert peak_flops("a100", "bf16") == pytest.approx(312e12)
    assert peak_flops("trn1", "bf16") == pytest.approx(190e12)
    assert peak_flops("trn2", "fp32") == pytest.approx(181e12)
    assert get_device("h200").memory_bytes == 141e9
    assert get_device("trn2").memory_bytes == 96 * 1024**3
    for name in ("h100", "h200", "a100", "trn1", "trn2"):
        spec = DEVICES[name]
        assert {"fp32", "bf16"} <= set(spec.peak_flops) and spec.intra_node_bw and spec.inter_node_bw
    with pytest.raises(DeviceError, match="valid"):
        get_device("tpu-v9")
    with pytest.raises(DeviceError, match="dtype"):
        peak_flops("h100", "int3")


def test_detect_device_is_cpu_here_and_env_overrides(monkeypatch):
    from plait.devices import _match_cuda_name, detect_device

    monkeypatch.delenv("PLAIT_DEVICE", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    spec = detect_device()
    assert spec.name == "cpu" and spec.measured and spec.memory_bytes > 0
    monkeypatch.setenv("PLAIT_DEVICE", "trn2")
    assert detect_device().name == "trn2"
    assert _match_cuda_name("NVIDIA H100 80GB HBM3") == "h100"
    assert _match_cuda_name("NVIDIA H100 PCIe") is None
    assert _match_cuda_name("NVIDIA H200") == "h200"
    assert _match_cuda_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert _match_cuda_name("NVIDIA GeForce RTX 4090") is None


def test_cpu_probe_is_cached(monkeypatch, tmp_path):
    import plait.devices as devices

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    calls = []

    def fake_probe(dtype, *, device="cpu", threads=None, **kw):
        calls.append((dtype, device, threads))
        return 1.5e11 if dtype == "fp32" else 4e10

    monkeypatch.setattr(devices, "measure_matmul_flops", fake_probe)
    assert devices.peak_flops("cpu", "fp32", threads=2) == 1.5e11
    assert calls == [("fp32", "cpu", 2)]
    assert devices.peak_flops("cpu", "fp32", threads=2) == 1.5e11  # read back, no matmul
    assert len(calls) == 1
    assert devices.peak_flops("cpu", "bf16", threads=2) == 4e10  # another dtype is another probe
    assert devices.peak_flops("cpu", "fp32", threads=1) == 1.5e11  # and so is another thread count
    assert len(calls) == 3
    cached = json.loads((tmp_path / "device_peaks.json").read_text())
    assert len(cached) == 3
    key = next(k for k in cached if k.endswith("|fp32") and "threads=2" in k)
    assert devices.cpu_model() in key and torch.__version__ in key


def test_real_probe_measures_something():
    from plait.devices import measure_matmul_flops

    threads = torch.get_num_threads()
    assert measure_matmul_flops("fp32", threads=1, n=64, reps=2) > 1e6
    assert torch.get_num_threads() == threads  # restored


# ------------------------------------------------------------------------------------ sinks
def test_jsonl_sink_writes_flushed_lines(tmp_path):
    from plait.train.loggers import JsonlSink

    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3, "grad_norm": 0.75, "tokens_per_s": 1234.0, "mfu": 0.31})
    lines = path.read_text().splitlines()  # visible before close: flushed on every write
    assert len(lines) == 1
    sink.log(2, {"val_loss": 2.25})
    sink.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["step"] == 1 and first["loss"] == 2.5 and first["lr"] == 1e-3
    assert first["grad_norm"] == 0.75 and first["tokens_per_s"] == 1234.0 and first["mfu"] == 0.31
    assert isinstance(first["time"], float)
    assert second == {"step": 2, "time": second["time"], "val_loss": 2.25}
    appended = JsonlSink(path, append=True)
    appended.log(3, {"loss": 2.0})
    appended.close()
    assert len(path.read_text().splitlines()) == 3


def test_tensorboard_sink_writes_readable_scalars_under_grouped_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.train.loggers import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    for step, loss in [(1, 3.0), (2, 2.5), (3, 2.0)]:
        sink.log(step, {"loss": loss, "lr": 0.1 * step, "note": "text is skipped", "tokens_per_s": 100.0 * step})
    sink.log(3, {"val_loss": 2.25, "val_loss/kjv": 2.5, "mfu": torch.tensor(0.25)})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "perf/tokens_per_s", "perf/mfu", "val/loss",
                                          "val/loss/kjv"}
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([3.0, 2.5, 2.0])
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([0.1, 0.2, 0.3])
    assert [(e.step, e.value) for e in acc.Scalars("val/loss/kjv")] == [(3, 2.5)]
    assert acc.Scalars("perf/mfu")[0].value == pytest.approx(0.25)


def test_grouped_metric_names():
    from plait.tracking.metric_names import grouped_name, grouped_scalars

    assert [grouped_name(k) for k in ("loss", "lr", "grad_norm", "rewards/accuracy", "skipped_steps")] == [
        "train/loss", "train/lr", "train/grad_norm", "train/rewards/accuracy", "train/skipped_steps"]
    assert [grouped_name(k) for k in ("val_loss", "val_perplexity", "val_loss/web", "val_rewards/margin",
                                      "val_exact_match")] == [
        "val/loss", "val/perplexity", "val/loss/web", "val/rewards/margin", "val/exact_match"]
    assert [grouped_name(k) for k in ("tokens_per_s", "mfu", "peak_memory_gb", "data_wait_share", "compile_s")] == [
        "perf/tokens_per_s", "perf/mfu", "perf/peak_memory_gb", "perf/data_wait_share", "perf/compile_s"]
    assert grouped_scalars({"step": 3, "loss": torch.tensor(1.5), "flag": True, "note": "x", "lr": 1}) == {
        "train/loss": 1.5, "train/lr": 1.0}


def test_progress_sink_and_multisink(tmp_path):
    from plait.train.loggers import JsonlSink, MultiSink, ProgressSink

    out = io.StringIO()
    bar = ProgressSink(10, enabled=True, file=out)
    quiet_out = io.StringIO()
    quiet = ProgressSink(10, enabled=False, file=quiet_out)
    multi = MultiSink([bar, quiet, JsonlSink(tmp_path / "m.jsonl")])
    multi.log(1, {"loss": 3.25, "lr": 3e-4, "tokens_per_s": 5000.0})
    multi.log(4, {"loss": 2.5, "lr": 3e-4, "tokens_per_s": 5100.0})
    assert bar._bar.n == 4
    multi.close()
    text = out.getvalue()
    assert "loss=2.5" in text and "tok/s=5100" in text and "lr=3.00e-04" in text and "4/10" in text
    assert quiet_out.getvalue() == ""
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_multisink_closes_all_then_raises():
    from plait.train.loggers import MetricsSink, MultiSink

    closed = []

    class Bad(MetricsSink):
        def close(self):
            raise OSError("disk gone")

    class Good(MetricsSink):
        def close(self):
            closed.append(True)

    with pytest.raises(OSError, match="disk gone"):
        MultiSink([Bad(), Good()]).close()
    assert closed == [True]


def test_default_sinks_only_on_rank_zero(tmp_path):
    from plait.train.loggers import default_sinks

    assert default_sinks(tmp_path / "r1", 5, rank=1).sinks == []
    sinks = default_sinks(tmp_path / "r0", 5, rank=0, tensorboard=False, progress=False)
    sinks.log(1, {"loss": 1.0})
    sinks.close()
    assert (tmp_path / "r0" / "metrics.jsonl").is_file()


def test_peak_memory_bytes_cpu():
    from plait.train.loggers import peak_memory_bytes

    before = peak_memory_bytes("cpu")
    assert before > 10 * 1024**2  # a Python process with torch loaded is well over 10 MiB
    assert peak_memory_bytes(torch.device("cpu")) >= before


# ------------------------------------------------------------------------------------ report
def _write_run(path):
    from plait.train.loggers import JsonlSink

    sink = JsonlSink(path)
    for step in range(1, 11):
        sink.log(step, {"loss": 5.0 - 0.3 * step + (0.5 if step == 10 else 0.0), "lr": 1e-3,
                        "tokens_per_s": 1000.0 + 10 * step, "mfu": 0.2 + 0.01 * step,
                        "step_time_s": 0.5, "data_wait_s": 0.05, "peak_memory_bytes": 3 * 1024**3 + step,
                        "elapsed_s": 0.5 * step + 2.0})
        if step % 5 == 0:
            sink.log(step, {"val_loss": 4.0 - 0.1 * step})
    sink.close()


def test_plot_run_writes_png(tmp_path):
    from plait.train.report import plot_run

    metrics = tmp_path / "run" / "metrics.jsonl"
    _write_run(metrics)
    out = plot_run(metrics, tmp_path / "plots" / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_of_a_preference_run_has_a_reward_panel(tmp_path):
    """A preference run's plot has three panels (loss, rewards, tokens/s); a plain run two."""
    import json

    from matplotlib.image import imread

    from plait.train.report import plot_run

    plain = tmp_path / "plain" / "metrics.jsonl"
    _write_run(plain)
    pref = tmp_path / "pref" / "metrics.jsonl"
    pref.parent.mkdir()
    lines = [json.loads(line) for line in plain.read_text().splitlines()]
    for i, rec in enumerate(lines):
        if "loss" in rec:
            rec.update({"rewards/accuracy": min(1.0, 0.5 + 0.02 * i), "rewards/margin": 0.1 * i})
        if "val_loss" in rec:
            rec.update({"val_rewards/accuracy": 0.6, "val_rewards/margin": 0.05 * i})
    pref.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    tall = imread(plot_run(pref, tmp_path / "pref.png"))
    short = imread(plot_run(plain, tmp_path / "plain.png"))
    assert tall.shape[0] > short.shape[0] * 1.3, (tall.shape, short.shape)
    grpo = tmp_path / "grpo" / "metrics.jsonl"  # a GRPO run gets the rollout rewards panel
    grpo.parent.mkdir()
    for i, rec in enumerate(lines):
        for key in ("rewards/accuracy", "rewards/margin", "val_rewards/accuracy", "val_rewards/margin"):
            rec.pop(key, None)
        if "loss" in rec:
            rec.update({"reward/mean": 0.1 * i, "accuracy": 0.05 * i})
        if "val_loss" in rec:
            rec["val_exact_match"] = 0.3
    grpo.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    assert imread(plot_run(grpo, tmp_path / "grpo.png")).shape == tall.shape


def test_summary_table_content(tmp_path):
    from plait.train.report import summarize, summary_table

    metrics = tmp_path / "metrics.jsonl"
    _write_run(metrics)
    with open(metrics, "a") as f:
        f.write('{"step": 11, "loss": 1.0')  # a run killed mid-write: ignored
    s = summarize(metrics)
    assert s["steps"] == 10
    assert s["final_loss"] == pytest.approx(2.5) and s["best_loss"] == pytest.approx(2.3)
    assert s["best_loss_step"] == 9
    assert s["final_val_loss"] == pytest.approx(3.0) and s["best_val_loss_step"] == 10
    assert s["median_tokens_per_s"] == pytest.approx(1055.0)
    assert s["median_mfu"] == pytest.approx(0.255)
    assert s["data_wait_share"] == pytest.approx(0.1)
    assert s["wall_time_s"] == pytest.approx(7.0)
    table = summary_table(metrics)
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "value"]
    row = {line[:16].strip(): line[16:].strip() for line in lines[2:]}
    assert row["final loss"] == "2.5000"
    assert row["best loss"] == "2.3000 (step 9)"
    assert row["final val loss"] == f"3.0000, ppl {math.exp(3.0):.2f}"
    assert row["median tokens/s"] == "1,055"
    assert row["median MFU"] == "25.50%"
    assert row["peak memory"] == "3.00 GiB"
    assert row["data-wait share"] == "10.0%"
    assert row["wall time"] == "7.0 s"


def test_summary_of_sparse_run_shows_na(tmp_path):
    from plait.train.report import summary_table

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 4.0}\n')
    table = summary_table(metrics)
    assert "final loss" in table and "4.0000" in table
    assert table.count("n/a") >= 6
    with pytest.raises(FileNotFoundError, match="does not exist"):
        summary_table(tmp_path / "missing.jsonl")


def test_summary_of_trainer_style_records(tmp_path):
    """The trainer logs every ``log_every`` steps with interval shares and memory in GB."""
    from plait.train.report import summarize, summary_table

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "time": 100.0, "loss": 3.0, "tokens_per_s": 900.0, "mfu": 0.1,
             "peak_memory_gb": 1.5, "data_wait_share": 0.2},
            {"step": 20, "time": 104.0, "loss": 2.0, "tokens_per_s": 1100.0, "mfu": 0.3,
             "peak_memory_gb": 2.0, "data_wait_share": 0.1, "val_loss": 2.5, "val_perplexity": 12.18}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(metrics)
    assert s["peak_memory_bytes"] == pytest.approx(2e9)
    assert s["data_wait_share"] == pytest.approx(0.15)
    assert s["wall_time_s"] == pytest.approx(8.0)  # 4 s for steps 10..20, extended back to step 0
    assert s["median_tokens_per_s"] == pytest.approx(1000.0) and s["median_mfu"] == pytest.approx(0.2)
    assert s["final_val_loss"] == 2.5
    assert "1.86 GiB" in summary_table(metrics)


def test_summary_shows_reward_accuracy_and_margin_of_a_preference_run(tmp_path):
    import json

    from plait.train.report import summary_table

    records = [{"step": 10, "loss": 0.6, "rewards/accuracy": 0.5, "rewards/margin": 0.1},
               {"step": 20, "loss": 0.4, "rewards/accuracy": 0.75, "rewards/margin": 1.25,
                "val_loss": 0.5, "val_rewards/accuracy": 0.8, "val_rewards/margin": 2.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = summary_table(path)
    assert "reward accuracy      75.00%" in table and "val reward margin    +2.0000" in table
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    assert "reward" not in summary_table(plain)
