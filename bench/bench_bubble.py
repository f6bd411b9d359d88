"""Measured pipeline bubble of plait's runtime vs theory, and stage-time balance of the partitioner.

**Part 1, bubble.** For each pipeline size ``p`` in ``--pps`` the script starts ``p`` gloo ranks on the
CPU (one intra-op thread each) and runs plait's :class:`~plait.pipeline.runtime.PipelineRuntime`
with each schedule of ``--schedules`` (default ``1f1b``, ``interleaved-1f1b`` with ``vpp=2``, the
zero-bubble ``zb-h1`` and ``interleaved-zb``, also with ``--vpp`` chunks) for every ``m`` in
``--microbatches``, on a
Llama whose blocks dominate (small vocabulary, decoder layers split evenly over the ``p * vpp``
stages). Training schedule only: no optimizer step (gradients are set to ``None`` between steps).

The runtime is not modified: :class:`TimedRuntime` replaces its task list by an iterable that
timestamps each task (a task ends when the runtime's loop asks for the next one). Per step and
rank: ``compute`` = wall time inside ``Forward``, ``Backward`` and ``WeightGrad`` tasks (zb-h1's B
and W); the step's makespan ``T`` =
the slowest rank's ``run()`` time (all ranks leave a barrier together). Measured bubble of rank
``r`` = ``1 - compute_r / T`` (the definition of ``plait.pipeline.simulate``); the table gives each
rank's median over ``--rounds`` steps, averaged over ranks, and the range of those per-rank medians.
Columns to compare with:

* ``theory``: ``schedule_bubble(name, p, m, vpp)`` (1F1B's ``(p-1)/(vpp m + p-1)``, the zero-bubble
  schedules' with ``F = B = W``): equal stages, no
  communication cost;
* ``sim: uniform stages``: ``plait.pipeline.simulate.simulate`` with this run's median forward and
  backward time of one chunk and the measured one-way p2p time of one activation (gloo
  ping-pong between ranks 0 and 1);
* ``sim: measured stages``: the same schedules simulated with each *global stage's* own median
  forward/backward time (:func:`simulate_stages`): adds the imbalance of the end stages
  (embedding on stage 0, norm + head + loss on the last); ``stage F+B max/mean`` quantifies it;
* the measured bubble split into where the idle time goes (shares of ``T``, mean over ranks):
  inside receive tasks (waiting for the peer, and the transfer), inside send tasks (issuing
  ``isend``), inside ``run()`` but outside any task (runtime loop overhead, the final wait on
  pending sends), and after ``run()`` returned, until the slowest rank's did (``done early``: the
  cool-down tail of the schedule);
* ``CPU-busy bubble``: the same as the measured bubble but with compute counted as the thread CPU
  time inside the tasks. It differs from the wall-based figure only when ranks compete for cores
  (``p`` ranks on fewer cores: a descheduled rank's task takes longer in wall time, not in CPU
  time); ``F wall/CPU`` (median forward wall time / CPU time) > 1 shows the same contention.

**Peak memory** per schedule: each rank resets its peak resident set (``/proc/self/clear_refs``)
before every timed step and reads ``VmHWM`` after it; ``peak MiB`` is that peak minus the RSS at
the step's start (gradients, activations, deferred W inputs and communication buffers), the
maximum over ranks (rank 0 for 1F1B) and the per-rank values. glibc's allocator is pinned as in
``bench/measure_memory.py`` (``MALLOC_MMAP_THRESHOLD_=65536``) so freed tensors leave the RSS.

**Part 2, stage balance** (one process, one thread). A model with a large vocabulary relative to
its blocks (default vocab 32000, hidden 256, 8 layers, seq 128) is split into ``--balance-stages``
stages by ``plan_partition`` with ``balanced``/``flops`` (plait's default), ``balanced``/``params``
and ``even``. Each stage is built with ``build_stages`` and its forward + backward (including
the embedding on stage 0 and norm, head and loss on the last) is timed on one micro-batch; the
table gives each stage's median time and max/mean (1.0 = perfectly balanced; a pipeline's steady
state runs at the pace of the slowest stage). For reference also the predicted cost share and
the sum of ``measure_unit_times`` over each stage's units (which omits the loss).

Run (from the repository root, venv active)::

    python bench/bench_bubble.py            # both parts
    python bench/bench_bubble.py --smoke    # tiny end-to-end check
    python bench/bench_bubble.py --skip-balance --pps 4 --microbatches 8 --schedules 1f1b,zb-h1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table, random_batch, spawn_gloo_ranks  # noqa: E402
from plait.materialize import build_model, build_stages  # noqa: E402
from plait.mesh import ParallelMesh, single_process_mesh  # noqa: E402
from plait.models.llama.config import LlamaConfig  # noqa: E402
from plait.pipeline import tasks as T  # noqa: E402
from plait.pipeline.runtime import PipelineRuntime  # noqa: E402
from plait.pipeline.schedules import (  # noqa: E402
    INTERLEAVED_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    schedule_tasks,
)
from plait.pipeline.simulate import schedule_bubble, simulate  # noqa: E402
from plait.plan.pipeline_split import plan_partition  # noqa: E402

DEFAULTS = dict(
    # part 1: blocks dominate, one chunk forward (1 layer, 1 x 256 tokens) ~16 ms on one thread
    vocab=512, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, seq=256, micro_batch_size=1,
    pps="2,4", microbatches="4,8", vpp=2, rounds=4, warmup=1, schedules="1f1b,interleaved-1f1b,zb-h1,interleaved-zb",
    # part 2
    bal_vocab=32000, bal_hidden=256, bal_intermediate=688, bal_layers=8, bal_heads=4, bal_kv_heads=2,
    bal_seq=128, balance_stages=4, bal_iters=7,
)
SMOKE = dict(vocab=256, hidden=64, intermediate=128, layers=8, heads=4, kv_heads=2, seq=32, micro_batch_size=1,
             pps="2,4", microbatches="4", vpp=2, rounds=2, warmup=1,
             schedules="1f1b,interleaved-1f1b,zb-h1,interleaved-zb",
             bal_vocab=2048, bal_hidden=64, bal_intermediate=128, bal_layers=8, bal_heads=4, bal_kv_heads=2,
             bal_seq=32, balance_stages=4, bal_iters=2)


def llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          seq: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max(seq, 128), rope_theta=10000.0, tie_word_embeddings=False)


# ------------------------------------------------------------------------------- timed runtime
class _TimedTasks:
    """The runtime's task list, iterated with a timestamp around each task.

    ``PipelineRuntime.run`` does ``for task in self.tasks``; the generator resumes after the loop
    body of a task has run, so ``(wall, thread CPU)`` before the yield and after it bracket exactly
    that task's execution (a receive includes its wait).
    """

    def __init__(self, tasks: list) -> None:
        self.tasks = list(tasks)
        self.records: list[tuple[object, float, float]] = []

    def __iter__(self):
        self.records = []
        for task in self.tasks:
            w0, c0 = time.perf_counter(), time.thread_time()
            yield task
            self.records.append((task, time.perf_counter() - w0, time.thread_time() - c0))

    def __len__(self) -> int:
        return len(self.tasks)


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (VmHWM) of this process (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


COMPUTE = (T.Forward, T.Backward, T.WeightGrad)


class TimedRuntime(PipelineRuntime):
    """``PipelineRuntime`` that records the wall and CPU time of every task of the last ``run``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tasks = _TimedTasks(self.tasks)

    def timed_step(self, batch: torch.Tensor) -> dict:
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)
        dist.barrier()
        _reset_peak_rss()
        rss0 = _status_kib("VmRSS")
        t0 = time.perf_counter()
        self.run(batch, train=True)
        wall = time.perf_counter() - t0
        peak_mib = (_status_kib("VmHWM") - rss0) / 1024
        rec = self.tasks.records
        compute = [(t, w, c) for t, w, c in rec if isinstance(t, COMPUTE)]
        fwd: dict[str, list[float]] = {}
        bwd: dict[str, list[float]] = {}
        wgt: dict[str, list[float]] = {}
        for t, w, _ in compute:  # per global stage (JSON keys are strings)
            kind = fwd if isinstance(t, T.Forward) else bwd if isinstance(t, T.Backward) else wgt
            kind.setdefault(str(self._global_stage(t.chunk)), []).append(w)
        return dict(peak_mib=peak_mib, wgt=wgt,
            wall=wall,
            tasks_wall=sum(w for _, w, _ in rec),
            compute_wall=sum(w for _, w, _ in compute),
            compute_cpu=sum(c for _, _, c in compute),
            recv_wall=sum(w for t, w, _ in rec if isinstance(t, (T.RecvActivation, T.RecvGradient))),
            send_wall=sum(w for t, w, _ in rec if isinstance(t, (T.SendActivation, T.SendGradient))),
            fwd=fwd, bwd=bwd,
            fwd_cpu=[c for t, _, c in compute if isinstance(t, T.Forward)],
        )


def p2p_one_way(shape: tuple[int, ...], group, peers: list[int], rank: int, iters: int = 20) -> float:
    """Median one-way time of one activation-sized message between the first two pipeline ranks."""
    buf = torch.randn(shape)
    samples = []
    if rank not in peers[:2]:
        return float("nan")
    other = peers[1] if rank == peers[0] else peers[0]
    for i in range(iters + 2):
        t0 = time.perf_counter()
        if rank == peers[0]:
            dist.send(buf, other, group=group)
            dist.recv(buf, other, group=group)
        else:
            dist.recv(buf, other, group=group)
            dist.send(buf, other, group=group)
        if i >= 2:
            samples.append((time.perf_counter() - t0) / 2)
    return statistics.median(samples)


def bubble_worker(rank: int, world: int, args: argparse.Namespace, out_path: str) -> None:
    config = llama(args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.seq)
    ms = [int(x) for x in args.microbatches.split(",")]
    mbs, seq = args.micro_batch_size, args.seq
    ids = random_batch(config, max(ms) * mbs, seq, 0)
    mesh = ParallelMesh(world, rank, pp=world)
    pp_group = mesh.group("pp")
    configs = []  # (label, vpp, m, runtime)
    for name in args.schedules.split(","):
        vpp = args.vpp if name in INTERLEAVED_SCHEDULES else 1
        num = world * vpp
        if config.num_hidden_layers < num:
            raise SystemExit(f"{config.num_hidden_layers} layers cannot fill {num} stages")
        layers = plan_partition(config, num, seq, method="even").stage_layers()
        # own stages per schedule: zb-h1 attaches its weight-gradient queue to the layers
        stages = [s.train() for s in build_stages(config, mesh, layers, seed=0)]
        for m in ms:
            rt = TimedRuntime(stages, mesh, schedule=name, microbatches=m, micro_batch_size=mbs, seq_len=seq,
                              hidden_size=config.hidden_size, sequence_parallel=False, dtype=torch.float32)
            configs.append((name, vpp, m, rt, ids[: m * mbs].view(m, mbs, seq)))
    lat = p2p_one_way((mbs, seq, config.hidden_size), pp_group, mesh.my_group_ranks("pp"), rank)
    lat_t = torch.tensor([0.0 if lat != lat else lat], dtype=torch.float64)
    dist.all_reduce(lat_t, op=dist.ReduceOp.MAX)
    for _ in range(args.warmup):
        for *_, rt, batch in configs:
            rt.timed_step(batch)
    samples: list[list[dict]] = [[] for _ in configs]
    for _r in range(args.rounds):  # configurations interleaved, one step each per round
        for i, (*_, rt, batch) in enumerate(configs):
            samples[i].append(rt.timed_step(batch))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(samples, gathered, dst=0)
    if rank == 0:
        rows = []
        for i, (name, vpp, m, _, _) in enumerate(configs):
            per_rank = [g[i] for g in gathered]  # [rank][round] -> record
            rows.append(dict(p=world, m=m, vpp=vpp, schedule=name, p2p_s=lat_t.item(), steps=[
                [per_rank[rk][k] for rk in range(world)] for k in range(args.rounds)]))
        with open(out_path, "w") as f:
            json.dump(rows, f)


def simulate_stages(pp: int, m: int, vpp: int, name: str, f: list[float], b: list[float], p2p: float,
                    w: list[float] | None = None) -> float:
    """Mean bubble of ``schedule_tasks(name, ...)`` on all ranks with per-*stage* forward/backward
    times ``f[s]``/``b[s]`` and a fixed one-way p2p time (``plait.pipeline.simulate`` semantics:
    sends are free and non-blocking, a receive waits for its send + ``p2p``). Unlike
    ``simulate``, stages may differ (embedding on stage 0, head and loss on the last). ``w[s]``: the
    WeightGrad time of a split-backward schedule (``b[s]`` is then its B)."""
    lists = [schedule_tasks(name, r, pp, m, vpp) for r in range(pp)]
    sent: dict[tuple[str, int, int], float] = {}
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                t = lists[r][pos[r]]
                if not isinstance(t, T.ReduceGradients):
                    s = t.chunk * pp + r
                    if isinstance(t, T.SendActivation):
                        sent["a", t.microbatch, s + 1] = clock[r]
                    elif isinstance(t, T.SendGradient):
                        sent["g", t.microbatch, s - 1] = clock[r]
                    elif isinstance(t, (T.RecvActivation, T.RecvGradient)):
                        key = ("a" if isinstance(t, T.RecvActivation) else "g", t.microbatch, s)
                        if key not in sent:
                            break
                        clock[r] = max(clock[r], sent[key] + p2p)
                    else:
                        d = f[s] if isinstance(t, T.Forward) else b[s] if isinstance(t, T.Backward) else w[s]
                        clock[r] += d
                        busy[r] += d
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(lists[r]) for r in range(pp)), "deadlock in simulate_stages"
    return 1.0 - sum(busy) / (pp * max(clock))


def summarize(row: dict) -> dict:
    p, m, vpp, name = row["p"], row["m"], row["vpp"], row["schedule"]
    per_rank, cpu_rank, makespans = [], [], []
    shares = {"recv": [], "send": [], "other": [], "early": []}
    for step in row["steps"]:  # one record per rank
        t = max(r["wall"] for r in step)
        makespans.append(t)
        per_rank.append([1 - r["compute_wall"] / t for r in step])
        cpu_rank.append([1 - r["compute_cpu"] / t for r in step])
        shares["recv"].append(statistics.fmean(r["recv_wall"] / t for r in step))
        shares["send"].append(statistics.fmean(r["send_wall"] / t for r in step))
        # inside run() but outside any task: loop overhead, the final wait on pending sends
        shares["other"].append(statistics.fmean((r["wall"] - r["tasks_wall"]) / t for r in step))
        # run() returned before the slowest rank's (the cool-down tail of the schedule)
        shares["early"].append(statistics.fmean((t - r["wall"]) / t for r in step))
    stages = range(p * vpp)

    def stage_median(kind: str, s: int) -> float:
        return statistics.median(x for step in row["steps"] for r in step for x in r[kind].get(str(s), []))

    split = name in SPLIT_BACKWARD_SCHEDULES
    f = [stage_median("fwd", s) for s in stages]
    b = [stage_median("bwd", s) for s in stages]
    w = [stage_median("wgt", s) for s in stages] if split else [0.0] * len(b)
    fb = [x + y + z for x, y, z in zip(f, b, w, strict=True)]
    fwd_all = statistics.median(x for step in row["steps"] for r in step for v in r["fwd"].values() for x in v)
    bwd_all = statistics.median(x for step in row["steps"] for r in step for v in r["bwd"].values() for x in v)
    wgt_all = (statistics.median(x for step in row["steps"] for r in step for v in r["wgt"].values() for x in v)
               if split else 0.0)
    peaks = [max(step[rk]["peak_mib"] for step in row["steps"]) for rk in range(p)]
    fwd_cpu = statistics.median(x for step in row["steps"] for r in step for x in r["fwd_cpu"])
    rank_med = [statistics.median(pr[rk] for pr in per_rank) for rk in range(p)]
    return dict(p=p, m=m, vpp=vpp, schedule=name, theory=schedule_bubble(name, p, m, vpp),
                sim_uniform=simulate(p, m, vpp, name, forward_time=fwd_all * vpp,
                                     backward_time=(bwd_all + wgt_all) * vpp, p2p_time=row["p2p_s"],
                                     weight_time=wgt_all * vpp if split else None).mean_bubble,
                sim_stages=simulate_stages(p, m, vpp, name, f, b, row["p2p_s"], w),
                peak_mib=max(peaks), peaks=peaks, wgt_ms=1e3 * wgt_all,
                imbalance=max(fb) / statistics.fmean(fb),
                measured=statistics.fmean(rank_med), rank_min=min(rank_med), rank_max=max(rank_med),
                cpu=statistics.fmean(statistics.median(pr[rk] for pr in cpu_rank) for rk in range(p)),
                **{k: statistics.median(v) for k, v in shares.items()},
                step_ms=1e3 * statistics.median(makespans), fwd_ms=1e3 * fwd_all, bwd_ms=1e3 * bwd_all,
                contention=fwd_all / fwd_cpu, p2p_ms=1e3 * row["p2p_s"])


def bubble_table(rows: list[dict]) -> str:
    header = ["p", "m", "schedule", "theory", "sim: uniform stages", "sim: measured stages", "measured bubble",
              "per-rank range", "= recv wait", "+ send", "+ outside tasks", "+ done early", "CPU-busy bubble",
              "stage F+B(+W) max/mean", "step ms", "F ms/chunk", "B ms/chunk", "W ms/chunk", "F wall/CPU", "p2p ms",
              "peak MiB (max; per rank)"]
    out = []
    for s in rows:
        sched = {"1f1b": "1F1B", "zb-h1": "ZB-H1"}.get(s["schedule"], f"{s['schedule']} vpp={s['vpp']}")
        out.append([str(s["p"]), str(s["m"]), sched, f"{s['theory']:.3f}", f"{s['sim_uniform']:.3f}",
                    f"{s['sim_stages']:.3f}", f"**{s['measured']:.3f}**", f"{s['rank_min']:.3f}-{s['rank_max']:.3f}",
                    f"{s['recv']:.3f}", f"{s['send']:.3f}", f"{s['other']:.3f}", f"{s['early']:.3f}", f"{s['cpu']:.3f}",
                    f"{s['imbalance']:.3f}", f"{s['step_ms']:.0f}", f"{s['fwd_ms']:.1f}", f"{s['bwd_ms']:.1f}",
                    f"{s['wgt_ms']:.1f}" if s["schedule"] in SPLIT_BACKWARD_SCHEDULES else "-",
                    f"{s['contention']:.2f}", f"{s['p2p_ms']:.2f}",
                    f"{s['peak_mib']:.0f}; " + " / ".join(f"{x:.0f}" for x in s["peaks"])])
    return markdown_table(header, out)


# ------------------------------------------------------------------------------- stage balance
def _stage_step(stage, config: LlamaConfig, ids: torch.Tensor, seq: int, hidden: torch.Tensor,
                grad: torch.Tensor) -> float:
    """Seconds of one forward + backward of ``stage`` on one micro-batch."""
    stage.zero_grad(set_to_none=True)
    x = ids if stage.first else hidden.clone().requires_grad_()
    t0 = time.perf_counter()
    out = stage(x, seq, labels=ids if stage.last else None)
    if stage.last:
        out.backward()
    else:
        out.backward(grad)
    return time.perf_counter() - t0


def balance(args: argparse.Namespace) -> str:
    from plait.pipeline.partition import measure_unit_times
    from plait.pipeline.trace import trace_units

    torch.set_num_threads(1)
    config = llama(args.bal_vocab, args.bal_hidden, args.bal_intermediate, args.bal_layers, args.bal_heads,
                   args.bal_kv_heads, args.bal_seq)
    seq, n = args.bal_seq, args.balance_stages
    ids = random_batch(config, args.micro_batch_size, seq, 0)
    full = build_model(config, single_process_mesh(), seed=0).train()
    units = trace_units(full)
    unit_s = dict(zip((u.name for u in units),
                      measure_unit_times(full, units, (ids, ids), warmup=1, iters=args.bal_iters), strict=True))
    del full
    splits = []  # (label, partition, [stage per global stage])
    for method, cost in (("balanced", "flops"), ("balanced", "params"), ("even", "flops")):
        part = plan_partition(config, n, seq, method=method, cost=cost)
        layers = part.stage_layers()
        stages = [build_stages(config, ParallelMesh(n, s, pp=n, create_groups=False), layers, seed=0)[0].train()
                  for s in range(n)]
        label = f"{method} ({cost})" if method == "balanced" else "even (by layer count)"
        splits.append((label, part, stages))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(ids.shape[0], seq, config.hidden_size, generator=gen)
    grad = torch.randn(ids.shape[0], seq, config.hidden_size, generator=gen)
    samples = {(i, s): [] for i in range(len(splits)) for s in range(n)}
    for it in range(args.bal_iters + 1):  # every stage of every split once per round; round 0 is warm-up
        for i, (_, _, stages) in enumerate(splits):
            for s, stage in enumerate(stages):
                t = _stage_step(stage, config, ids, seq, hidden, grad)
                if it:
                    samples[i, s].append(t)
    rows = []
    for i, (label, part, _) in enumerate(splits):
        times = [statistics.median(samples[i, s]) for s in range(n)]
        unit_sum = [sum(unit_s[name] for name in names) for names in part.stages]
        fcost = plan_partition(config, n, seq, method="manual", cost="flops", cuts=part.cuts()).costs
        rows.append([label, " / ".join(str(len(x)) for x in part.stage_layers()),
                     f"{max(fcost) / statistics.fmean(fcost):.3f}",
                     " / ".join(f"{1e3 * t:.1f}" for t in times), f"{max(times) / statistics.fmean(times):.3f}",
                     f"{1e3 * max(times):.1f}",
                     " / ".join(f"{1e3 * t:.1f}" for t in unit_sum),
                     f"{max(unit_sum) / statistics.fmean(unit_sum):.3f}"])
    desc = (f"model: vocab {config.vocab_size}, hidden {config.hidden_size}, intermediate "
            f"{config.intermediate_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
            f"{config.num_key_value_heads} kv heads, untied; micro-batch {args.micro_batch_size} x {seq}; "
            f"{n} stages; medians of {args.bal_iters} runs (all stages of all splits interleaved), 1 thread")
    header = ["split", "blocks per stage", "FLOP-cost max/mean", "measured stage F+B ms", "measured max/mean",
              "slowest stage ms", "measure_unit_times sum ms (no loss)", "unit-sum max/mean"]
    return desc + "\n\n" + markdown_table(header, rows)


# ------------------------------------------------------------------------------- processes
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                            help=f"default {value} (smoke {SMOKE[key]})")
    parser.add_argument("--skip-bubble", action="store_true", help="only part 2 (stage balance)")
    parser.add_argument("--skip-balance", action="store_true", help="only part 1 (bubble)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, end-to-end check only")
    args = parser.parse_args(argv)
    base = SMOKE if args.smoke else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # freed tensors leave the RSS (see the module doc); inherited by the spawned ranks
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    print(f"torch {torch.__version__}; 1 intra-op thread per rank; os.cpu_count()={os.cpu_count()}; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    if not args.skip_bubble:
        config = llama(args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.seq)
        print(f"bubble model: {config.num_parameters() / 1e6:.1f}M params (vocab {args.vocab}, hidden {args.hidden}, "
              f"intermediate {args.intermediate}, {args.layers} layers, {args.heads}/{args.kv_heads} heads), layers "
              f"split evenly; micro-batch {args.micro_batch_size} x {args.seq}; {args.warmup} warm-up + "
              f"{args.rounds} timed steps per configuration (configurations interleaved); no optimizer step",
              flush=True)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for p in (int(x) for x in args.pps.split(",")):
                out_path = os.path.join(tmp, f"p{p}.json")
                spawn_gloo_ranks(p, bubble_worker, (args, out_path))
                with open(out_path) as f:
                    rows += [summarize(r) for r in json.load(f)]
                print(f"p={p} done (load average {os.getloadavg()[0]:.2f})", flush=True)
        print()
        print(bubble_table(rows), flush=True)
        print()
    if not args.skip_balance:
        print(balance(args), flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
