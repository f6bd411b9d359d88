"""The training loop of one rank: step, log, evaluate, checkpoint, stop on a signal.

One code path for every layout, objective and feature: everything a recipe turns on is built by
:func:`plait.train.build_run.build_run` and enters the loop through the hooks of
:mod:`plait.train.plugins` (the objective's validation and metrics, each feature's step hooks)
and the run's final export; the end-of-run outputs are :mod:`plait.train.finish`. Inside a step
nothing is read back to the host; the loss and gradient norm sums are read once per logging
interval. Rank 0 writes the metrics; every rank takes part in the collectives they need.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from plait.config.resolve import ResolvedRecipe
from plait.data.batch import TokenBatch
from plait.models.flops import mfu
from plait.train.build_run import build_run
from plait.train.finish import finish_run
from plait.train.loggers import peak_memory_bytes
from plait.train.run import Run
from plait.train.step import train_step


class Trainer:
    """Loops over one rank's :class:`~plait.train.run.Run`. ``fit()`` trains and returns the final
    metrics; ``finish()`` writes the end-of-run outputs."""

    def __init__(self, resolved: ResolvedRecipe, prepared_dir: str | Path, rank: int, world: int) -> None:
        self.run: Run = build_run(resolved, prepared_dir, rank, world)
        self.state = self.run.state
        self.steps_trained = 0

    @property
    def stopped_by_signal(self) -> int:
        """The agreed stop signal once one ended training or its outputs (0: none)."""
        return self.run.signals.stopped_by

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, *, sync: bool = False) -> float:
        """Snapshot this rank's state and write it (in the background unless ``sync``); returns the
        seconds the training loop was held up."""
        return self.run.checkpoints.save(step, sync=sync)

    def finish_checkpoints(self) -> None:
        """Wait for the background save; every rank returns only after the checkpoint is committed."""
        self.run.checkpoints.finish()

    def watch(self, operation: str, axis: str) -> AbstractContextManager[None]:
        """Time a communicating phase for the stall watchdog, naming its group(s) and their ranks."""
        mesh = self.state.mesh
        groups = []
        for name in (a.strip() for a in axis.replace(" and ", ",").split(",")):
            if name in ("tp", "pp", "dp", "cp", "kv", "tied") and mesh.info(name).size > 1:
                groups.append(f"group {name}, ranks {mesh.my_group_ranks(name)}")
        return self.run.watchdog.watch(operation, "; ".join(groups) or "no peers")

    # ------------------------------------------------------------------ loop
    def run_step(self, batch: torch.Tensor | TokenBatch) -> float:
        """One optimizer step and its device-side metrics; returns the learning rate it used.

        Nothing in here reads a device value on the host (tests/test_trainer.py counts).
        """
        st, run = self.state, self.run
        r = st.recipe
        skip = r.train.nonfinite == "skip"
        plugins = [st.objective, *st.plugins]
        for plugin in plugins:
            plugin.start_step()
        loss, norm = train_step(st.runtime, st.optimizer, batch, grad_clip=r.optimizer.grad_clip,
                                skip_nonfinite=skip, watch=self.watch)
        for plugin in plugins:
            plugin.end_step(norm)
        run.watchdog.step += 1
        lr = st.scheduler.get_last_lr()[0]
        assert isinstance(lr, float), "the schedule scales optimizer.lr, a Python float (no host read)"
        st.scheduler.step()
        run.metrics.add(loss, norm, skip_nonfinite=skip)
        return lr

    def fit(self) -> dict[str, Any]:
        """Train from the start step to ``train.steps`` (or to a stop signal); returns the last record.

        A step stopped by SIGTERM/SIGINT is checkpointed and then logged like any logging step
        (without evaluation, to leave quickly), so the log and the checkpoint end at the same step.
        """
        st, run = self.state, self.run
        r = st.recipe
        steps, log_every, eval_every = r.train.steps, r.train.log_every, r.train.eval_every
        save_every = r.checkpoint.save_every
        last: dict[str, Any] = {}
        interval_start, interval_wait0 = time.perf_counter(), 0.0
        run_start = interval_start
        batches = iter(run.loader)
        run.signals.stopped_by = 0
        self.steps_trained = 0
        run.signals.install()
        for plugin in [st.objective, *st.plugins]:
            plugin.start_run()
        detector = run.host_syncs
        try:
            for step in range(st.start_step, steps):
                batch = next(batches)
                watching = not detector.done
                with detector.step(step):
                    lr = self.run_step(batch)
                if watching and (detector.done or step + 1 == steps):
                    self._report_host_syncs()
                done = step + 1
                self.steps_trained += 1
                signum = run.signals.requested()
                if signum:
                    self._guard_finite(done)
                    # read before the save, so that the save does not count against the throughput
                    last = self._train_record(done, lr, interval_start, interval_wait0, run_start)
                    self.save_checkpoint(done, sync=True)
                    run.signals.stopped_by = last["stopped_by_signal"] = signum
                    self._log(done, last)
                    if run.is_writer:
                        print(f"stopped by signal {signum} after step {done}; checkpoint written to "
                              f"{st.resolved.save_dir}", flush=True)
                    break
                if save_every and (done % save_every == 0 or done == steps):
                    self._guard_finite(done)
                    self.save_checkpoint(done)
                if done % log_every == 0 or done == steps:
                    last = self._train_record(done, lr, interval_start, interval_wait0, run_start)
                    if done % eval_every == 0 or done == steps:
                        last.update(self.evaluate())
                    self._log(done, last)
                    # the next interval starts after evaluation and logging, so they do not count
                    # against the training throughput
                    interval_start, interval_wait0 = time.perf_counter(), run.loader.wait_seconds
        finally:
            run.loader.close()
            if run.sinks is not None:
                run.sinks.close()
            run.checkpoints.writer.wait()  # a save in flight completes even when training stops on an error
            run.watchdog.close()
        self.finish_checkpoints()
        last["wall_seconds"] = time.perf_counter() - run_start
        last["steps_trained"] = self.steps_trained
        last["final_step"] = st.start_step + self.steps_trained
        return last

    def evaluate(self) -> dict[str, float]:
        """The objective's validation scores: the same sequences under every layout
        (:mod:`plait.train.evaluation`)."""
        return self.state.objective.evaluate()

    def finish(self, final: dict[str, Any]) -> None:
        """The end-of-run outputs (:func:`plait.train.finish.finish_run`)."""
        finish_run(self.run, final)

    def _report_host_syncs(self) -> None:
        """Print what the detector found: every rank that found a read, and rank 0 always."""
        detector = self.run.host_syncs
        if detector.reads or self.run.is_writer:
            print(f"[rank {self.state.rank}] {detector.report()}", flush=True)

    def _train_record(self, done: int, lr: float, interval_start: float, interval_wait0: float,
                      run_start: float) -> dict[str, Any]:
        """The logged numbers of the interval ending at step ``done`` (collective: every rank calls it)."""
        st, run = self.state, self.run
        now = time.perf_counter()
        n = run.metrics.steps
        record: dict[str, Any] = {"step": done, **run.metrics.read(average_over=st.dp, loss_from=st.pp), "lr": lr}
        record.update(st.objective.interval_metrics(done))
        if not math.isfinite(record["loss"]) and "skipped_steps" not in record:
            raise FloatingPointError(f"loss became {record['loss']} at step {done}; lower "
                                     f"optimizer.lr or enable optimizer.grad_clip")
        wait = run.loader.wait_seconds - interval_wait0
        # time a feature spent on one-off work (compiling) is left out of the interval's throughput
        untimed = sum(plugin.untimed_seconds() for plugin in st.plugins)
        for plugin in st.plugins:
            record.update(plugin.interval_metrics(done))
        record.update(self._throughput_fields(n, now - interval_start - untimed, wait))
        record["elapsed_s"] = now - run_start
        return record

    def _throughput_fields(self, steps: int, seconds: float, data_wait: float) -> dict[str, float]:
        st, run = self.state, self.run
        tps = steps * st.resolved.tokens_per_step / max(seconds, 1e-9)
        per_device = tps / st.world
        return {"tokens_per_s": tps, "tokens_per_s_per_device": per_device,
                "mfu": mfu(per_device, run.flops_per_token, run.peak_flops),
                "peak_memory_gb": peak_memory_bytes(st.device) / 1e9,
                "data_wait_share": data_wait / max(seconds, 1e-9)}

    def _log(self, done: int, record: dict[str, Any]) -> None:
        if self.run.sinks is not None:
            self.run.sinks.log(done, record)

    def _guard_finite(self, step: int) -> None:
        """Refuse to checkpoint a state reached through a non-finite loss (read since the last log)."""
        if not self.run.metrics.finite():
            raise FloatingPointError(f"a non-finite loss or gradient norm occurred before step {step}; no "
                                     f"checkpoint was written (train.nonfinite={self.state.recipe.train.nonfinite!r})")
