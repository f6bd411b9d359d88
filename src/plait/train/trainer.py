"""The training run of one rank: build, train, evaluate, log, and write the run's outputs.

One code path for every layout the mesh supports. Inside a step nothing is read back to the
host; the loss and gradient norm sums are read once per logging interval. Rank 0 writes the
outputs (metrics, TensorBoard, plot, summary, final Hugging Face checkpoint, sample); every rank
takes part in the collectives they need.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.checkpoint.convert import plait_to_hf
from plait.checkpoint.format import step_dir_name
from plait.checkpoint.store import latest_checkpoint
from plait.checkpoint.training import checkpoint_meta, rng_states
from plait.checkpoint.writer import CheckpointWriter
from plait.config.resolve import ResolvedRecipe
from plait.context_parallel.apply import whole_sequences
from plait.data.baseline import unigram_loss
from plait.data.batch import TokenBatch
from plait.data.loader import BatchLoader
from plait.data.sampler import GlobalBatchSampler
from plait.data.tokenizer_files import TOKENIZER_FILE, copy_model_use_files, model_use_files
from plait.devices import detect_device, peak_flops
from plait.generate import generate
from plait.lora import save_peft_adapter
from plait.lora.peft_io import BASE_SUBDIR
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.flops import mfu, model_flops_per_token
from plait.models.hf_io import write_local_model
from plait.moe import is_moe_config, moe_layers, read_moe_stats
from plait.moe.load_map import MOE_LOAD_FILE, append_load, plot_load_map
from plait.moe.step_load import attach_load_balancing
from plait.pipeline.stages_lm import StagesCausalLM
from plait.train.build_run import build_run
from plait.train.compile import compile_seconds
from plait.train.evaluation import evaluate, evaluate_preference
from plait.train.host_syncs import HostSyncDetector
from plait.train.loggers import (
    JsonlSink,
    MetricsSink,
    MultiSink,
    ProgressSink,
    TensorBoardSink,
    keep_metrics_through,
    peak_memory_bytes,
)
from plait.train.report import plot_run, summary_table
from plait.train.run_state import RunState
from plait.train.running_metrics import RunningMetrics
from plait.train.step import train_step
from plait.train.watchdog import Watchdog

#: size cap of one file of the final Hugging Face checkpoint (Hugging Face's own default)
FINAL_SHARD_BYTES = 5 * 1024**3
#: where the final model's checkpoint is written when the run keeps none (removed after conversion)
FINAL_EXPORT_DIR = ".plait-final-export"


class Trainer:
    """Owns the state of one rank's run. ``fit()`` trains and returns the final metrics."""

    def __init__(self, resolved: ResolvedRecipe, prepared_dir: str | Path, rank: int, world: int) -> None:
        self.state: RunState = build_run(resolved, prepared_dir, rank, world)
        st = self.state
        self.resolved, self.recipe = resolved, resolved.recipe
        r = self.recipe
        self.rank, self.world = rank, world
        self.out = Path(resolved.output_dir)
        self.watchdog = Watchdog(r.train.stall_timeout_s, rank, dump_dir=self.out)  # hang/rank-N.txt on a stall
        c = r.checkpoint
        self.checkpoints = CheckpointWriter(resolved.save_dir, rank=rank, world=world, keep=c.keep,
                                            keep_every=c.keep_every)
        self._stop_signal = 0
        self.stopped_by_signal = 0  # the agreed stop signal once one ended training or its outputs
        sampler = GlobalBatchSampler(len(st.train_data), resolved.global_batch_size, r.run.seed)
        self.loader = BatchLoader(st.train_data, sampler, dp_rank=st.dp.rank, dp=st.dp.size,
                                  microbatches=r.parallel.microbatches, prefetch=r.data.prefetch,
                                  start_step=st.start_step)
        self.metrics = RunningMetrics(st.device)
        # MoE: the step's expert load over the replicas (global-batch aux loss, sigmoid router bias); None if unused
        self.load_balancing = attach_load_balancing(
            st.stages, r.moe, st.mesh.info("dp_cp"), microbatches=r.parallel.microbatches,
            sequence=st.mesh.info("tp") if r.parallel.sequence_parallel else None)
        self.peak_flops = self._measure_peak_once()
        self.is_writer = rank == 0
        self.sinks = self._build_sinks() if self.is_writer else None
        self._compile_mark = compile_seconds()  # compile time already counted (train.compile)
        self._compile_total = 0.0  # compile time of the slowest rank so far, as compile_s reports it

    # views of the run state that the loop and the tests read
    @property
    def start_step(self) -> int:
        return self.state.start_step

    @property
    def optimizer(self):
        return self.state.optimizer

    @property
    def tp(self):
        return self.state.tp

    @property
    def dp(self):
        return self.state.dp

    @property
    def pp(self):
        return self.state.pp

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, *, sync: bool = False, writer: CheckpointWriter | None = None) -> float:
        """Snapshot this rank's state and write it (in the background unless ``sync``); returns the
        seconds the training loop was held up. ``writer``: another root than the run's save dir."""
        start = time.perf_counter()
        st = self.state
        attachments = self._model_use_files()  # tokenizer, chat template, ...: plait convert writes them out
        writer = writer or self.checkpoints
        snap = writer.snapshot(step, st.stages, st.optimizer, st.mesh, checkpoint_meta(st, step), rng_states(st),
                               attachments)
        self.last_snapshot_bytes = snap.nbytes
        if self.recipe.checkpoint.async_save and not sync:
            writer.write_async(snap)
        else:
            writer.write(snap)
        return time.perf_counter() - start

    def finish_checkpoints(self) -> None:
        """Wait for the background save; every rank returns only after the checkpoint is committed."""
        self.checkpoints.wait()
        if self.world > 1:
            dist.barrier(group=self.state.control)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
            # the first signal is the user's (Ctrl-C's SIGINT reaches the workers before the launcher
            # forwards its SIGTERM)
            self._stop_signal = self._stop_signal or signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def watch(self, operation: str, axis: str):
        """Time a communicating phase for the stall watchdog, naming its group(s) and their ranks."""
        groups = []
        for name in (a.strip() for a in axis.replace(" and ", ",").split(",")):
            if name in ("tp", "pp", "dp", "cp", "kv", "tied") and self.state.mesh.info(name).size > 1:
                groups.append(f"group {name}, ranks {self.state.mesh.my_group_ranks(name)}")
        return self.watchdog.watch(operation, "; ".join(groups) or "no peers")

    def _slowest_rank(self, seconds: float) -> float:
        """The largest of every rank's ``seconds`` (at a logging step, when all ranks are here)."""
        control = self.state.control
        if control is None:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64)
        with self.watchdog.watch("compile time (all-reduce of each rank's seconds)", "all ranks"):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control)
        return float(value[0])

    def _stop_requested(self) -> int:
        """The signal any rank received (0: none), agreed by all ranks at a step boundary."""
        control = self.state.control
        if control is None:
            return self._stop_signal
        flag = torch.tensor([self._stop_signal], dtype=torch.int64)
        with self.watchdog.watch("preemption check (all-reduce of the stop flag)", "all ranks"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
        return int(flag[0])

    def _measure_peak_once(self) -> float:
        """The per-device peak FLOP/s, measured (CPU) or looked up once, on rank 0, then shared.

        Measuring on one rank while the others wait keeps the matmul probe from competing with
        itself on a shared host; it also keeps the probe out of every timed interval.
        """
        dtype = "fp32" if self.recipe.precision.preset == "fp32" else "bf16"
        value = torch.zeros(1, dtype=torch.float64)
        if self.rank == 0:
            value[0] = peak_flops(detect_device(), dtype, torch.get_num_threads())
        if self.world > 1:
            buf = value.to(self.state.device)  # NCCL needs a device tensor; gloo takes the CPU one
            dist.broadcast(buf, src=0)
            value = buf.cpu()
        return float(value[0])

    # ------------------------------------------------------------------ outputs
    def _build_sinks(self) -> MultiSink:
        """Rank 0's sinks. A resumed run continues the run's ``metrics.jsonl`` from its start step
        (records past it, from steps trained again now, are dropped); a fresh run starts it anew."""
        lg = self.recipe.logging
        self.out.mkdir(parents=True, exist_ok=True)
        sinks: list[MetricsSink] = []
        if lg.jsonl:
            metrics = self.out / "metrics.jsonl"
            resumed = self.start_step > 0 and metrics.is_file()
            if resumed:
                keep_metrics_through(metrics, self.start_step)
            sinks.append(JsonlSink(metrics, append=resumed))
        if lg.tensorboard:
            sinks.append(TensorBoardSink(self.out / "tensorboard"))
        sinks.append(ProgressSink(self.recipe.train.steps, enabled=lg.progress_bar, initial=self.start_step))
        return MultiSink(sinks)

    def _throughput_fields(self, steps: int, seconds: float, data_wait: float) -> dict[str, float]:
        tokens = steps * self.resolved.tokens_per_step
        tps = tokens / max(seconds, 1e-9)
        per_device = tps / self.world
        fpt = model_flops_per_token(self.state.config, self.recipe.data.seq_len,
                                    weight_gradients=self.recipe.lora.rank is None)  # a frozen base: 4N
        return {"tokens_per_s": tps, "tokens_per_s_per_device": per_device,
                "mfu": mfu(per_device, fpt, self.peak_flops),
                "peak_memory_gb": peak_memory_bytes(self.state.device) / 1e9,
                "data_wait_share": data_wait / max(seconds, 1e-9)}

    # ------------------------------------------------------------------ loop
    def run_step(self, batch: torch.Tensor | TokenBatch) -> float:
        """One optimizer step and its device-side metrics; returns the learning rate it used.

        Nothing in here reads a device value on the host (tests/test_trainer.py counts).
        """
        r, st = self.recipe, self.state
        skip = r.train.nonfinite == "skip"
        if self.load_balancing is not None:
            self.load_balancing.start_step()
        loss, norm = train_step(st.runtime, st.optimizer, batch, grad_clip=r.optimizer.grad_clip,
                                skip_nonfinite=skip, watch=self.watch)
        if self.load_balancing is not None:  # after the optimizer step: the sigmoid routers' expert biases
            self.load_balancing.finish_step(norm)
        self.watchdog.step += 1
        lr = st.scheduler.get_last_lr()[0]
        assert isinstance(lr, float), "the schedule scales optimizer.lr, a Python float (no host read)"
        st.scheduler.step()
        self.metrics.add(loss, norm, skip_nonfinite=skip)
        return lr

    def fit(self) -> dict[str, Any]:
        """Train from ``start_step`` to ``train.steps`` (or to a stop signal); returns the last record.

        A step stopped by SIGTERM/SIGINT is checkpointed and then logged like any logging step
        (without evaluation, to leave quickly), so the log and the checkpoint end at the same step.
        """
        r = self.recipe
        steps, log_every, eval_every = r.train.steps, r.train.log_every, r.train.eval_every
        last: dict[str, Any] = {}
        interval_start, interval_wait0 = time.perf_counter(), 0.0
        run_start = interval_start
        batches = iter(self.loader)
        c = r.checkpoint
        self.stopped_by_signal = 0
        self.steps_trained = 0
        self._install_signal_handlers()
        detector = HostSyncDetector(self.state.device, steps=3) if r.train.detect_host_syncs else None
        try:
            for step in range(self.start_step, steps):
                batch = next(batches)
                if detector is not None and not detector.done:
                    with detector.step(step):
                        lr = self.run_step(batch)
                    if detector.done or step + 1 == steps:
                        self._report_host_syncs(detector)
                else:
                    lr = self.run_step(batch)
                done = step + 1
                self.steps_trained += 1
                signum = self._stop_requested()
                if signum:
                    self._guard_finite(done)
                    # read before the save, so that the save does not count against the throughput
                    last = self._train_record(done, lr, interval_start, interval_wait0, run_start)
                    self.save_checkpoint(done, sync=True)
                    self.stopped_by_signal = last["stopped_by_signal"] = signum
                    self._log(done, last)
                    if self.rank == 0:
                        print(f"stopped by signal {signum} after step {done}; checkpoint written to "
                              f"{self.resolved.save_dir}", flush=True)
                    break
                if c.save_every and (done % c.save_every == 0 or done == steps):
                    self._guard_finite(done)
                    self.checkpoint_stall_s = self.save_checkpoint(done)
                if done % log_every == 0 or done == steps:
                    last = self._train_record(done, lr, interval_start, interval_wait0, run_start)
                    if done % eval_every == 0 or done == steps:
                        last.update(self._eval_fields())
                    self._log(done, last)
                    # the next interval starts after evaluation and logging, so they do not count
                    # against the training throughput
                    interval_start, interval_wait0 = time.perf_counter(), self.loader.wait_seconds
        finally:
            self.loader.close()
            if self.sinks is not None:
                self.sinks.close()
            self.checkpoints.wait()  # a save in flight completes even when training stops on an error
            self.watchdog.close()
        self.finish_checkpoints()
        last["wall_seconds"] = time.perf_counter() - run_start
        last["steps_trained"] = self.steps_trained
        last["final_step"] = self.start_step + self.steps_trained
        return last

    def _report_host_syncs(self, detector: HostSyncDetector) -> None:
        """Print what the detector found: every rank that found a read, and rank 0 always."""
        if detector.reads or self.rank == 0:
            print(f"[rank {self.rank}] {detector.report()}", flush=True)

    def _train_record(self, done: int, lr: float, interval_start: float, interval_wait0: float,
                      run_start: float) -> dict[str, Any]:
        """The logged numbers of the interval ending at step ``done`` (collective: every rank calls it)."""
        now = time.perf_counter()
        n = self.metrics.steps
        record = {"step": done, **self.metrics.read(average_over=self.dp, loss_from=self.pp), "lr": lr}
        if self.state.preference is not None:  # pair-weighted over the interval; the step losses stay in "loss"
            pairs = self.state.preference.read("train", self.pp, self.dp)
            pairs.pop("loss", None)
            record.update(pairs)
        if not math.isfinite(record["loss"]) and "skipped_steps" not in record:
            raise FloatingPointError(f"loss became {record['loss']} at step {done}; lower "
                                     f"optimizer.lr or enable optimizer.grad_clip")
        if is_moe_config(self.state.config):  # per MoE layer, averaged over the ranks holding it
            moe, loads = read_moe_stats(moe_layers(self.state.stages), self.state.control, self.world)
            record.update(moe)
            if self.is_writer and loads:
                append_load(self.out / MOE_LOAD_FILE, done, loads)
        wait = self.loader.wait_seconds - interval_wait0
        # compiling (train.compile: the first steps, and any recompilation) is reported as compile_s
        # and left out of the interval's throughput
        compiled, self._compile_mark = compile_seconds() - self._compile_mark, compile_seconds()
        if self.recipe.train.compile:
            compiled = self._slowest_rank(compiled)  # a later pipeline stage's compile stalls rank 0 too
            self._compile_total += compiled
            record["compile_s"] = self._compile_total
        record.update(self._throughput_fields(n, now - interval_start - compiled, wait))
        record["elapsed_s"] = now - run_start
        return record

    def _log(self, done: int, record: dict[str, Any]) -> None:
        if self.sinks is not None:
            self.sinks.log(done, record)

    def _guard_finite(self, step: int) -> None:
        """Refuse to checkpoint a state reached through a non-finite loss (read since the last log)."""
        if not self.metrics.finite():
            raise FloatingPointError(f"a non-finite loss or gradient norm occurred before step {step}; no "
                                     f"checkpoint was written (train.nonfinite={self.recipe.train.nonfinite!r})")

    def _eval_fields(self) -> dict[str, float]:
        """Validation loss on the same sequences under every layout (see train/evaluation.py)."""
        r, st = self.recipe, self.state
        if st.preference is not None:
            return evaluate_preference(st.runtime, st.preference, st.val_data,
                                       global_batch=self.resolved.global_batch_size, batches=r.train.eval_batches,
                                       microbatches=r.parallel.microbatches, micro_batch_size=r.data.micro_batch_size,
                                       dp=st.dp, pp=st.pp)
        val = evaluate(st.runtime, st.val_data, global_batch=self.resolved.global_batch_size,
                       batches=r.train.eval_batches, microbatches=r.parallel.microbatches,
                       micro_batch_size=r.data.micro_batch_size, dp=st.dp, pp=st.pp)
        return {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}

    # ------------------------------------------------------------------ end of run
    def finish(self, final: dict[str, Any], prepared_dir: str | Path) -> None:
        """The end of every run, whatever the layout: the final Hugging Face checkpoint, the sample,
        then (rank 0) tokenizer, plot and summary.

        ``train.sample_tokens=0`` asks for no sample: nothing is generated or printed and no
        ``sample.txt`` is written.
        """
        r, st = self.recipe, self.state
        step = final.get("final_step", r.train.steps)
        if r.checkpoint.save_final and not self._stopped_before("the final export", step):
            if r.lora.rank is not None:
                self._export_adapter()
            else:
                self._export_final(step)
        sample = None
        if r.train.sample_tokens > 0 and not self._stopped_before("the sample", step):
            sample = self._sample(lambda: self._stopped_before("the sample", step))
            if self.stopped_by_signal:  # cut short: no partial sample is written
                sample = None
        if not self.is_writer:
            return
        # the tokenizer, chat template, special tokens and generation defaults travel with the model
        # (the final export wrote them into checkpoint.dir already; a run resumed from an older
        # checkpoint gets them here)
        copy_model_use_files(self.out, *self._model_use_sources())
        if r.checkpoint.save_final and Path(self.resolved.checkpoint_dir).is_dir():
            copy_model_use_files(self.resolved.checkpoint_dir, *self._model_use_sources())
        metrics_file = self.out / "metrics.jsonl"
        if r.logging.plot and metrics_file.exists():
            plot_run(metrics_file, self.out / "loss.png")
        if r.logging.plot and (self.out / MOE_LOAD_FILE).exists():  # expert load heat map of an MoE run
            plot_load_map(self.out / MOE_LOAD_FILE, self.out / "moe_load.png",
                          final.get("final_step", r.train.steps))
        summary = summary_table(metrics_file, self.start_step) if metrics_file.exists() else json.dumps(final, indent=1)
        if r.data.format == "text":  # the unigram baseline is of plain text; rows score their targets only
            baseline = unigram_loss(prepared_dir, st.train_data.vocab_size)
            summary += f"\nunigram baseline val loss {baseline:.4f} (a model ignoring context)"
            if "val_loss" in final:
                summary += f"; this run: {final['val_loss']:.4f}"
        (self.out / "summary.txt").write_text(summary + "\n")
        print("\n" + summary, flush=True)
        if r.checkpoint.save_final:
            what = "LoRA adapter (PEFT layout)" if r.lora.rank is not None else "Hugging Face checkpoint"
            print(f"final {what}: {self.resolved.checkpoint_dir}", flush=True)
        if sample is not None:
            (self.out / "sample.txt").write_text(sample + "\n")
            print(f"\nsample ({r.train.sample_tokens} tokens after {r.train.sample_prompt!r}):\n{sample}\n", flush=True)
        print(f"outputs in {self.out}", flush=True)

    def _stopped_before(self, what: str, step: int) -> bool:
        """Whether a stop signal came after training ended (all ranks agree): then ``what``, slow
        end-of-run work, is skipped so the run leaves before a preemption's grace period ends."""
        if self.stopped_by_signal:
            return True
        signum = self._stop_requested()
        if signum:
            self.stopped_by_signal = signum
            if self.rank == 0:
                print(f"stopped by signal {signum} after training ended at step {step}: {what} and the rest of "
                      f"the end-of-run outputs are skipped (the training checkpoints are in "
                      f"{self.resolved.save_dir}; run again with checkpoint.resume=auto to write them)", flush=True)
        return bool(signum)

    def _export_adapter(self) -> None:
        """A LoRA run's final model is its adapter in the PEFT layout (``adapter_config.json`` and
        ``adapter_model.safetensors``), loadable by ``peft`` onto ``model.hf_path``: the base weights
        did not change. Gathered over TP and the pipeline; global rank 0 writes."""
        st, r = self.state, self.recipe
        self.finish_checkpoints()
        final = Path(self.resolved.checkpoint_dir)
        # a random base (no model.hf_path) exists nowhere else: it is written inside the adapter
        # directory, and the adapter names it, so the adapter stays usable
        base = r.model.hf_path if r.model.hf_path is not None else str((final / BASE_SUBDIR).absolute())
        save_peft_adapter(st.stages, final, st.tp, base, pp=st.pp,
                          replace=True,  # checked before launch, as for the full model
                          extra_files=self._model_use_files() if self.is_writer else None)
        if r.model.hf_path is None and self.is_writer:
            self._write_random_base(final / BASE_SUBDIR)
        if self.world > 1:
            dist.barrier(group=st.control)

    def _write_random_base(self, directory: Path) -> None:
        """The frozen base of a LoRA run without ``model.hf_path``: the layout-invariant
        initialisation of ``run.seed`` (each weight a function of the seed and its name), rebuilt
        whole in this one process and written as a Hugging Face directory."""
        config = self.state.config
        model = build_model(config, single_process_mesh(), seed=self.recipe.run.seed,
                            dtype=self.state.policy.param_dtype)
        sources = self._model_use_sources()
        write_local_model(model, directory, max_shard_bytes=FINAL_SHARD_BYTES,
                          extra_files=[("model use files", lambda d: copy_model_use_files(d, *sources))])

    def _model_use_sources(self) -> tuple[Path, str | None]:
        """Where the files describing the model's use come from: the prepared data's tokenizer (the
        one trained with, with its chat template), then ``model.hf_path`` (its generation_config.json)."""
        data = self.state.train_data
        return data.directory / data.index.get("tokenizer", TOKENIZER_FILE), self.recipe.model.hf_path

    def _model_use_files(self) -> dict[str, Path]:
        return model_use_files(*self._model_use_sources())

    def _export_final(self, step: int) -> None:
        """Write the final Hugging Face model through the sharded checkpoint of ``step``.

        Every stage writes its own shard and rank 0 converts the checkpoint tensor by tensor, so no
        rank ever holds the whole model, under any layout. The run's own checkpoint of that step is
        used when ``save_every`` wrote one; otherwise a private one is written under the save
        directory (``.plait-final-export``) and removed after the conversion, so a run that asked
        for no checkpoints leaves none (and can simply be run again).
        """
        self.finish_checkpoints()
        source = latest_checkpoint(self.resolved.save_dir)
        export = None
        if source is None or source.name != step_dir_name(step):
            export = Path(self.resolved.save_dir) / FINAL_EXPORT_DIR
            writer = CheckpointWriter(export, rank=self.rank, world=self.world, keep=1)
            self.save_checkpoint(step, sync=True, writer=writer)
            writer.wait()
            if self.world > 1:
                dist.barrier(group=self.state.control)
            source = latest_checkpoint(export)
        if self.is_writer:
            if source is None:  # rank 0 committed it above; only the writer reads it back
                raise RuntimeError(f"the final export checkpoint of step {step} is not complete in {export}")
            plait_to_hf(source, self.resolved.checkpoint_dir, progress=False, overwrite=True,  # checked before launch
                        max_shard_bytes=FINAL_SHARD_BYTES)
            if export is not None:
                shutil.rmtree(export, ignore_errors=True)

    def _sample(self, should_stop: Callable[[], bool] | None = None) -> str:
        """``train.sample_tokens`` tokens generated after ``train.sample_prompt`` (every rank takes part;
        ``should_stop``, a collective, may end it early)."""
        r, st = self.recipe, self.state
        tokenizer = st.train_data.tokenizer()
        prompt = tokenizer.encode(r.train.sample_prompt).ids or [st.train_data.eos_id]
        with whole_sequences(st.stages):  # every cp rank generates from the whole prompt (no-op at cp=1)
            ids = generate(StagesCausalLM(st.stages, st.mesh), torch.tensor([prompt]), r.train.sample_tokens,
                           top_k=40, top_p=0.95, temperature=0.8, seed=r.run.seed, eos_id=st.train_data.eos_id,
                           should_stop=should_stop)
        return tokenizer.decode(ids[0].tolist())
