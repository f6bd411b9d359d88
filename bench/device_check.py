"""plait's device check: one command on a machine with one CUDA GPU, one table of results.

Run it through ``bash bench/device_check.sh`` (from anywhere; it puts ``src/`` on the path).
Steps, in order, each in processes of its own under a time limit, so that a failing, crashing or
hanging step is a ``FAIL`` row and the others still run:

1. ``cuda-tests``: the CUDA-marked tests, ``pytest -m cuda tests/test_cuda.py`` (fp32 training on
   the GPU against the CPU, bf16 runs, a one-rank NCCL group, the grouped expert matmul).
2. ``cuda-smoke``: ``bench/cuda_smoke.py`` on the Shakespeare plays prepared by ``plait data
   prepare``: packed rows on CUDA, four ``plait train`` runs (fp32, bf16-mixed, packed SFT with
   LoRA, DPO) that must learn.
3. ``bench-single``: ``bench/bench_single.py --device cuda`` in bf16 autocast on a 1.1B-parameter
   Llama (:data:`LLAMA_1B`) against transformers' twin; MFU against the GPU's *measured* bf16
   matmul peak (:func:`bench_single.measured_peak`), the datasheet figure beside it.
4. ``compile``: the same model eager and with ``train.compile``'s compiled blocks
   (``bench_single.py --compile --no-hf``): the compiled/eager tokens/s ratio and compile time.
5. ``moe``: a Mixtral (``bench/bench_moe.py``'s model) training in bf16 with the experts' grouped
   matmul (``torch._grouped_mm``, :mod:`plait.nn.moe.grouped`) and with the per-expert loop:
   both losses, the speed-up, and a count of grouped calls (the grouped path must be taken).
6. ``memory``: the 1.1B Llama trained two steps (bf16-mixed, two micro-batches) through plait's
   training path in a one-rank NCCL process group (:func:`plait.launch.init_worker`); CUDA's
   peak allocated memory against :func:`plait.plan.memory.estimate_memory` (estimate/measured,
   as ``bench/measure_memory.py`` reports it).

The real mode needs CUDA (it stops at once, status 2, without it) and runs one step at a time.
Each step has a time limit (:class:`Step`), cut to what is left of :data:`REAL_BUDGET_S`, so the
whole run ends in under 8 minutes: a step that outruns its limit is ended, with every process it
started, and marked ``FAIL``; the table is printed in every case.

``--dry-run`` runs the same steps, scripts and checks on the CPU at toy sizes, GPUs hidden from
every step, two steps at a time (``--jobs``): the tests are only collected; ``cuda_smoke.py
--smoke`` trains one tiny run and validates the other runs' recipes; the benchmarks run their
``--smoke`` sizes in fp32 (on a CPU without native bf16 the bf16 peak probe alone takes minutes);
the MoE step runs ``bench_moe.py``'s smoke model in fp32 (the grouped path's CPU dtype); peak
memory is the process's peak RSS, which at toy sizes is mostly the runtime's own. The dry run
keeps a plait cache of its own under ``OUT`` (a CPU peak measured while steps share the cores
must not reach the user's cache) but compiles into the user's compile cache
(``$TORCHINDUCTOR_CACHE_DIR``, else ``<plait cache>/compile``), so that only a first dry run
compiles. It exists so that the real mode cannot rot: ``tests/test_device_check.py`` runs it in
the default suite.

Exit status 0 when every step is ``ok``, 1 otherwise. Each step's output is in ``OUT/<step>.log``
(``--out``, default a new temporary directory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PY = sys.executable

#: a ~1.1B-parameter Llama (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 query and 4 K/V
#: heads of dim 64, vocabulary 32000), as bench_single's size flags
LLAMA_1B = dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4)
#: bench_single's run on the GPU: 8192 tokens a step, 3 rounds of 5 timed steps after 2 warm-up steps
BENCH_RUN = dict(batch=4, seq=2048, rounds=3, steps=5, warmup=2)
#: the MoE step's model on the GPU (bench_moe's config: 4 query / 2 K/V heads, so head dim 256)
#: and run: 8 experts of width 2048, top-2, 8192 tokens a step
MOE_REAL = dict(vocab=32000, hidden=1024, intermediate=2048, layers=4, experts=8, top_k=2, batch=8, seq=1024,
                rounds=3, steps=5, warmup=2)
#: the memory step: micro-batch, sequence, micro-batches per step, steps (AdamW's states exist from
#: the first step on, so the second step runs with every model state alive), precision preset
MEMORY_REAL = dict(micro_batch=2, seq=2048, microbatches=2, steps=2, precision="bf16-mixed")
MEMORY_DRY = dict(micro_batch=2, seq=32, microbatches=2, steps=2, precision="bf16-mixed")
#: the memory step's pass band of estimate/measured on the GPU
MEMORY_BAND = (0.5, 2.0)
#: the real mode's whole run stays within this (seconds): each step's limit is cut to what is left
REAL_BUDGET_S = 465.0
DRY_LIMIT_S = 240.0
DRY_BUDGET_S = 900.0


@dataclass
class Context:
    dry: bool
    out: Path
    threads: int

    def path(self, name: str) -> Path:
        return self.out / name

    def read_json(self, name: str) -> dict:
        path = self.path(name)
        if not path.exists():
            raise CheckFailed(f"{name} was not written")
        return json.loads(path.read_text())


class CheckFailed(Exception):
    """A step ran but its results are wrong; the message is the table's key figure."""


@dataclass
class Step:
    name: str
    #: seconds this step may take in the real mode
    limit_s: float
    #: the commands, run in order (each must exit 0)
    commands: Callable[[Context], list[list[str]]]
    #: the key figure, from the step's files and log; raises :class:`CheckFailed` when they are wrong
    check: Callable[[Context, str], str]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _size_flags(sizes: dict) -> list[str]:
    return [item for key, value in sizes.items() for item in (f"--{key.replace('_', '-')}", str(value))]


# ------------------------------------------------------------------------------ 1. cuda-tests
def tests_commands(ctx: Context) -> list[list[str]]:
    base = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/test_cuda.py"]
    return [base + ["--collect-only"]] if ctx.dry else [base + ["-rs"]]


def tests_check(ctx: Context, log: str) -> str:
    if ctx.dry:
        found = re.search(r"(\d+) tests? collected", log)
        count = int(found.group(1)) if found else 0
        if count < 3:
            raise CheckFailed(f"{count} CUDA tests collected (expected at least 3)")
        return f"{count} collected (CPU: not run)"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", log)}
    if counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise CheckFailed(f"{counts.get('failed', 0)} failed, {counts.get('error', counts.get('errors', 0))} errors")
    if not counts.get("passed"):
        raise CheckFailed(f"no CUDA test passed ({counts.get('skipped', 0)} skipped)")
    skipped = f", {counts['skipped']} skipped" if counts.get("skipped") else ""
    return f"{counts['passed']} passed{skipped}"


# ------------------------------------------------------------------------------ 2. cuda-smoke
TINY_WORDS = ("the king and his fool walk by night to the sea while the queen reads old letters of war "
              "and love in a cold tower far from home").split()


def smoke_commands(ctx: Context) -> list[list[str]]:
    data = ctx.path("data")
    smoke = [PY, str(BENCH / "cuda_smoke.py"), "--out", str(ctx.path("cuda-smoke")), "--json",
             str(ctx.path("cuda-smoke.json"))]
    if not ctx.dry:
        return [[PY, "-m", "plait.cli", "data", "prepare", "shakespeare", "--out", str(data / "shakespeare"),
                 "--no-progress"], smoke + ["--data", str(data / "shakespeare")]]
    data.mkdir(parents=True, exist_ok=True)
    corpus = data / "tiny.txt"  # a few thousand words of text: enough for a BPE and 32-token samples
    corpus.write_text("\n\n".join(" ".join(TINY_WORDS[(7 * i + j) % len(TINY_WORDS)] for j in range(40))
                                  for i in range(300)) + "\n")
    return [[PY, "-m", "plait.cli", "data", "prepare", str(corpus), "--vocab-size", "300", "--out",
             str(data / "tiny"), "--no-progress"], smoke + ["--data", str(data / "tiny"), "--smoke"]]


def smoke_check(ctx: Context, log: str) -> str:
    res = ctx.read_json("cuda-smoke.json")
    packed = res["packed"]
    if not (packed["max_logit_diff"] <= 1e-5 and packed["max_grad_diff"] <= 1e-4):
        raise CheckFailed(f"packed rows differ from the samples alone: {packed}")
    for run in res["runs"]:
        if run["status"] != 0:
            raise CheckFailed(f"plait train {run['name']}: exit status {run['status']} "
                              f"(see cuda-smoke/{run['name']}.log)")
        if not (_finite(run["first_loss"], run["last_loss"]) and run["last_loss"] < run["first_loss"]):
            raise CheckFailed(f"{run['name']}: loss {run['first_loss']} -> {run['last_loss']} did not fall")
    bad = [v["name"] for v in res["validated"] if not v["validated"]]
    if bad:
        raise CheckFailed(f"recipes refused: {', '.join(bad)}")
    fastest = max(res["runs"], key=lambda r: r["tokens_per_s"] or 0)
    n = len(res["runs"])
    figure = f"{n} run learns" if n == 1 else f"{n} runs learn"
    if res["validated"]:
        figure += f", {len(res['validated'])} recipes valid"
    return (figure + f"; packed diff {packed['max_logit_diff']:.1e}; {fastest['name']} "
            f"{fastest['tokens_per_s']:,.0f} tok/s")


# ------------------------------------------------------------------------------ 3, 4. bench_single
def _bench_flags(ctx: Context) -> list[str]:
    if ctx.dry:
        return ["--smoke", "--dtypes", "fp32", "--threads", str(ctx.threads), "--foreach"]
    return (["--device", "cuda", "--dtypes", "bf16-autocast", "--threads", str(ctx.threads), "--foreach"]
            + _size_flags({**LLAMA_1B, **BENCH_RUN}))


def bench_commands(ctx: Context) -> list[list[str]]:
    return [[PY, str(BENCH / "bench_single.py"), *_bench_flags(ctx), "--json", str(ctx.path("bench-single.json"))]]


def _label(ctx: Context) -> str:
    return "fp32" if ctx.dry else "bf16-autocast"


#: first-step losses of two implementations on the same weights and batch: fp32 round-off, or bf16's
LOSS_AGREEMENT = {"fp32": 1e-4, "bf16-autocast": 1e-2}


def bench_check(ctx: Context, log: str) -> str:
    res = ctx.read_json("bench-single.json")
    label = _label(ctx)
    d = res["dtypes"][label]
    ours, theirs = d["contestants"]["plait"], d["contestants"]["HF"]
    if not (ours["finite"] and theirs["finite"]):
        raise CheckFailed(f"non-finite losses: plait {ours['first_loss']}, HF {theirs['first_loss']}")
    if _relative(ours["first_loss"], theirs["first_loss"]) > LOSS_AGREEMENT[label]:
        raise CheckFailed(f"first-step losses differ: plait {ours['first_loss']:.6f}, HF {theirs['first_loss']:.6f}")
    if not ours["mfu"] > 0 or (not ctx.dry and ours["mfu"] > 1):
        raise CheckFailed(f"MFU {ours['mfu']:.3f} is not in (0, 1]: the measured peak is wrong")
    sheet = res.get("datasheet_peak_bf16")
    return (f"{_count(res['parameters'])} {label}: {ours['tokens_per_s']:,.0f} tok/s, MFU {ours['mfu']:.1%} of "
            f"measured {d['peak_flops'] / 1e12:.3g} TFLOP/s" + (f" (datasheet {sheet / 1e12:.0f})" if sheet else "")
            + f"; plait/HF {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}")


def compile_commands(ctx: Context) -> list[list[str]]:
    return [[PY, str(BENCH / "bench_single.py"), *_bench_flags(ctx), "--compile", "--no-hf", "--json",
             str(ctx.path("compile.json"))]]


def compile_check(ctx: Context, log: str) -> str:
    res = ctx.read_json("compile.json")
    label = _label(ctx)
    c = res["dtypes"][label]["contestants"]
    eager, compiled = c["plait"], c["plait-compiled"]
    if not (eager["finite"] and compiled["finite"]):
        raise CheckFailed(f"non-finite losses: eager {eager['first_loss']}, compiled {compiled['first_loss']}")
    if _relative(compiled["first_loss"], eager["first_loss"]) > LOSS_AGREEMENT[label]:
        raise CheckFailed(f"first-step losses differ: compiled {compiled['first_loss']:.6f}, "
                          f"eager {eager['first_loss']:.6f}")
    if not (compiled["compile_s"] or 0) > 0:
        raise CheckFailed("nothing was compiled (compile time 0)")
    ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
    return (f"compiled/eager {ratio:.2f} ({compiled['tokens_per_s']:,.0f} vs {eager['tokens_per_s']:,.0f} tok/s; "
            f"compile {compiled['compile_s']:.0f} s)")


# ------------------------------------------------------------------------------ 5. moe
def moe_commands(ctx: Context) -> list[list[str]]:
    return [[PY, str(Path(__file__).resolve()), "--step", "moe", *(["--dry-run"] if ctx.dry else []),
             "--threads", str(ctx.threads), "--json", str(ctx.path("moe.json"))]]


def moe_measure(dry: bool) -> dict:
    """A Mixtral training step with the grouped expert matmul and with the per-expert loop (same
    initial weights and batch, fused AdamW, alternating timed rounds): bf16 autocast on the GPU
    (the grouped path's dtype there), fp32 in the dry run (the grouped path's other dtype on the CPU)."""
    import statistics

    import torch

    import bench_moe
    from _common import device_sync, time_steps
    from plait.materialize import build_model
    from plait.mesh import single_process_mesh
    from plait.nn.moe import experts as experts_module

    device = torch.device("cpu" if dry else "cuda")
    autocast = None if dry else torch.bfloat16
    a = argparse.Namespace(**(bench_moe.SMOKE if dry else MOE_REAL))
    config = bench_moe.config_of(a)
    ids = bench_moe.batch_of(a, config).to(device)
    grouped_usable = experts_module.grouped_mm_usable
    paths = {"grouped": grouped_usable, "looped": lambda *args, **kwargs: False}
    calls = {name: 0 for name in paths}
    real_grouped_mm = torch._grouped_mm
    current = ["grouped"]

    def counting(*args, **kwargs):
        calls[current[0]] += 1
        return real_grouped_mm(*args, **kwargs)

    steps = {}
    for name, usable in paths.items():
        model = build_model(config, single_process_mesh(), seed=0, device=device).train()
        opt = bench_moe._optimizer(model, "fused")

        def step(model=model, opt=opt, usable=usable, name=name) -> torch.Tensor:
            experts_module.grouped_mm_usable = usable  # looked up by the experts at every call
            current[0] = name
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = model(ids, ids)
            loss.backward()
            opt.step()
            return loss.detach()

        steps[name] = step
    torch._grouped_mm = counting
    try:
        first = {name: float(step()) for name, step in steps.items()}  # same weights: the same loss
        per_step = dict(calls)
        for _ in range(a.warmup - 1):
            for step in steps.values():
                step()
        sync = device_sync(device)
        rates: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for r in range(a.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                wall, _ = time_steps(steps[name], a.steps, sync)
                rates[name].append(a.steps * a.batch * a.seq / wall)
        last = {name: float(step()) for name, step in steps.items()}
    finally:
        torch._grouped_mm = real_grouped_mm
        experts_module.grouped_mm_usable = grouped_usable
    return {"device": str(device), "dtype": "bf16-autocast" if autocast else "fp32",
            "parameters": config.num_parameters(), "first_loss": first, "last_loss": last,
            "grouped_calls_first_step": per_step, "tokens_per_s": {n: statistics.median(v) for n, v in rates.items()}}


def moe_check(ctx: Context, log: str) -> str:
    res = ctx.read_json("moe.json")
    first, calls, rate = res["first_loss"], res["grouped_calls_first_step"], res["tokens_per_s"]
    if not calls["grouped"]:
        raise CheckFailed("the grouped path was not taken (no torch._grouped_mm call)")
    if calls["looped"]:
        raise CheckFailed(f"the looped path called torch._grouped_mm {calls['looped']} times")
    if not _finite(*first.values(), *res["last_loss"].values()):
        raise CheckFailed(f"non-finite losses: {first}, {res['last_loss']}")
    diff = _relative(first["grouped"], first["looped"])
    if diff > 1e-2:
        raise CheckFailed(f"grouped loss {first['grouped']:.5f} vs looped {first['looped']:.5f}")
    return (f"{res['dtype']} grouped/looped {rate['grouped'] / rate['looped']:.2f} ({rate['grouped']:,.0f} vs "
            f"{rate['looped']:,.0f} tok/s), loss diff {diff:.1e}, {calls['grouped']} grouped calls/step")


# ------------------------------------------------------------------------------ 6. memory
def memory_commands(ctx: Context) -> list[list[str]]:
    return [[PY, str(Path(__file__).resolve()), "--step", "memory", *(["--dry-run"] if ctx.dry else []),
             "--threads", str(ctx.threads), "--json", str(ctx.path("memory.json"))]]


def memory_measure(dry: bool, threads: int) -> dict:
    """Two training steps of a Llama through plait's training path in a one-rank process group
    (NCCL on a GPU, gloo on the CPU: :func:`plait.launch.init_worker` picks it), and the peak
    memory above the bare runtime's against the planner's estimate of that step."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist

    import measure_memory
    from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
    from plait.launch import finish_worker, init_worker
    from plait.materialize import build_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama.config import LlamaConfig
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import estimate_memory
    from plait.precision import policy_for
    from plait.train.build_run import build_runtime
    from plait.train.step import train_step

    run = MEMORY_DRY if dry else MEMORY_REAL
    if dry:
        model_kw = measure_memory.SMOKE_MODEL
    else:
        s = LLAMA_1B
        model_kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv_heads"], tie_word_embeddings=False,
                        max_position_embeddings=run["seq"])
    rank, world = init_worker(threads)
    try:
        on_gpu = torch.cuda.is_available()
        if not dry and not on_gpu:
            raise RuntimeError("the memory step needs a CUDA GPU")
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        config = LlamaConfig(**model_kw)
        layout = ParallelDegrees()  # one device: tp = pp = dp = 1, no checkpointing
        mesh = ParallelMesh(world, rank)
        policy = policy_for(run["precision"])
        B, S, m = run["micro_batch"], run["seq"], run["microbatches"]
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, config.vocab_size, (m, B, S), generator=gen) for _ in range(run["steps"])]
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            before = measure_memory.rss_bytes()
            measure_memory.reset_peak_rss()
        (stage,) = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=0, device=device)
        optimizer = DistributedOptimizer([stage], policy, OptimizerHyper(lr=1e-4, weight_decay=0.1,
                                                                          betas=(0.9, 0.95), eps=1e-8),
                                         dp=mesh.info("dp_cp"), tp=mesh.info("tp"), pp=mesh.info("pp"))
        runtime = build_runtime([stage], mesh, policy, optimizer, schedule=layout.schedule, microbatches=m,
                                micro_batch_size=B, seq_len=S, sequence_parallel=False)
        for batch in batches:
            loss, _ = train_step(runtime, optimizer, batch, grad_clip=1.0)
        loss_value = float(loss)
        if on_gpu:
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device) - before
        else:
            measured = measure_memory.hwm_bytes() - before
        est = estimate_memory(config, layout, precision=run["precision"], micro_batch_size=B, seq_len=S,
                              microbatches=m)
        return {"device": str(device), "backend": dist.get_backend(), "parameters": config.num_parameters(),
                "estimate_parameters": est.parameter_count,
                "local_parameters": sum(p.numel() for p in stage.parameters()),
                "measured_bytes": measured, "estimate_bytes": est.total, "model_states_estimate": est.model_states,
                "how": "torch.cuda.max_memory_allocated" if on_gpu else "peak RSS", "loss": loss_value, **run}
    finally:
        finish_worker()


def memory_check(ctx: Context, log: str) -> str:
    res = ctx.read_json("memory.json")
    if not ctx.dry and res["backend"] != "nccl":
        raise CheckFailed(f"the process group is {res['backend']}, not nccl")
    if res["estimate_parameters"] != res["local_parameters"]:
        raise CheckFailed(f"the planner counts {res['estimate_parameters']} parameters, the model has "
                          f"{res['local_parameters']}")
    if not _finite(res["loss"]) or res["measured_bytes"] <= 0:
        raise CheckFailed(f"loss {res['loss']}, measured {res['measured_bytes']} bytes")
    ratio = res["estimate_bytes"] / res["measured_bytes"]
    figure = (f"estimate/measured {ratio:.2f} ({res['estimate_bytes'] / 2**30:.2f} vs "
              f"{res['measured_bytes'] / 2**30:.2f} GiB, {res['how']}, {res['precision']})")
    if ctx.dry:  # nothing to judge: a toy model's bytes are lost in the interpreter's and libraries' own
        figure += "; toy model: RSS is mostly the runtime's"
    if not ctx.dry and not MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]:
        raise CheckFailed(figure + f": outside {MEMORY_BAND[0]}-{MEMORY_BAND[1]}")
    return figure


STEPS = [
    Step("cuda-tests", 75, tests_commands, tests_check),
    Step("cuda-smoke", 170, smoke_commands, smoke_check),
    Step("bench-single", 75, bench_commands, bench_check),
    Step("compile", 130, compile_commands, compile_check),
    Step("moe", 45, moe_commands, moe_check),
    Step("memory", 45, memory_commands, memory_check),
]


# ------------------------------------------------------------------------------ running the steps
def child_env(ctx: Context) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "src"), str(BENCH)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if ctx.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU's, also on a machine with a GPU
        # a plait cache of the run's own: the CPU's matmul peak measured while the steps share the
        # cores must not land in the user's cache (plait train's MFU on the CPU reads it). The
        # compiled kernels of the toy model do go to the user's compile cache, so that a second
        # dry run loads them instead of compiling for half a minute.
        user_cache = Path(env.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(user_cache / "compile"))
        env["PLAIT_CACHE"] = str(ctx.path("cache"))
    return env


def run_command(cmd: list[str], env: dict[str, str], log, timeout: float) -> int | None:
    """Exit status of ``cmd`` (output appended to ``log``), or ``None`` when it outran ``timeout``
    (then it and every process it started are killed)."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None
    finally:
        try:  # a step's leftover processes (e.g. a launcher's workers) go with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("$ ")]
    return lines[-1][:160] if lines else ""


def run_step(step: Step, ctx: Context, limit: float) -> tuple[bool, str, float]:
    start = time.perf_counter()
    log_path = ctx.path(f"{step.name}.log")
    env = child_env(ctx)
    try:
        commands = step.commands(ctx)
        with open(log_path, "w") as log:
            for cmd in commands:
                left = limit - (time.perf_counter() - start)
                status = run_command(cmd, env, log, left)
                if status is None:
                    return False, f"timed out after {limit:.0f} s (see {log_path.name})", time.perf_counter() - start
                if status != 0:
                    tail = _last_line(log_path.read_text(errors="replace"))
                    return False, f"exit status {status}: {tail}", time.perf_counter() - start
        figure = step.check(ctx, log_path.read_text(errors="replace"))
        return True, figure, time.perf_counter() - start
    except CheckFailed as e:
        return False, str(e), time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a broken result file is this step's failure, not the run's
        return False, f"{type(e).__name__}: {e}"[:200], time.perf_counter() - start


def table(rows: list[tuple[str, str, str, float]]) -> str:
    lines = ["| step | status | key figure | seconds |", "|---|---|---|---:|"]
    lines += [f"| {name} | {status} | {figure.replace('|', '/')} | {seconds:.1f} |"
              for name, status, figure, seconds in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU at toy sizes (no GPU needed; tests collected only)")
    parser.add_argument("--out", help="directory for the logs and results (default: a new temporary directory)")
    parser.add_argument("--only", help=f"comma list of steps to run (default all: {', '.join(s.name for s in STEPS)})")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the benchmark steps (default: 2 in the dry run, up to 16 on the GPU)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="dry run: steps run at a time (default 2; the real mode runs one at a time)")
    parser.add_argument("--step", choices=["moe", "memory"], help=argparse.SUPPRESS)  # one step's measurement
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    threads = args.threads or (2 if args.dry_run else max(1, min(16, os.cpu_count() or 1)))
    if args.step:  # a child process of the driver: measure, write the JSON, no judging
        result = moe_measure(args.dry_run) if args.step == "moe" else memory_measure(args.dry_run, threads)
        Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    steps = STEPS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in STEPS})
        if unknown:
            parser.error(f"--only: unknown step(s) {', '.join(unknown)}; valid: {', '.join(s.name for s in STEPS)}")
        steps = [s for s in STEPS if s.name in wanted]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plait-device-check-"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(dry=args.dry_run, out=out.resolve(), threads=threads)
    mode = "dry run: the CPU, toy sizes" if ctx.dry else "CUDA"
    print(f"plait device check ({mode}); logs and results in {ctx.out}", flush=True)
    if not ctx.dry:
        probe = subprocess.run([PY, "-c", "import torch; print(torch.cuda.is_available() and "
                                "torch.cuda.get_device_name(0))"], capture_output=True, text=True,
                               env=child_env(ctx), cwd=ROOT)
        name = probe.stdout.strip()
        if probe.returncode != 0 or name in ("", "False"):
            print(f"no CUDA device here ({(probe.stderr.strip().splitlines() or [name])[-1]}); "
                  f"use --dry-run for the CPU check", file=sys.stderr)
            return 2
        print(f"device: {name}", flush=True)
    budget = DRY_BUDGET_S if ctx.dry else REAL_BUDGET_S
    started = time.perf_counter()

    def run(step: Step) -> tuple[bool, str, float]:
        left = budget - (time.perf_counter() - started)
        if left < 5:
            return False, "not run: the time budget is spent", 0.0
        return run_step(step, ctx, min(DRY_LIMIT_S if ctx.dry else step.limit_s, left))

    done = [0]

    def report(step: Step, result: tuple[bool, str, float]) -> None:
        done[0] += 1
        ok, figure, seconds = result
        print(f"[{done[0]}/{len(steps)}] {step.name}: {'ok' if ok else 'FAIL'} ({seconds:.1f} s) {figure}", flush=True)

    jobs = args.jobs if ctx.dry else 1  # on the GPU one step at a time: its timings are the point
    if jobs <= 1:
        results = []
        for step in steps:
            results.append(run(step))
            report(step, results[-1])
    else:  # the dry run's steps are independent and their timings meaningless: two at a time
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run, step): step for step in steps}
            for future in as_completed(futures):
                report(futures[future], future.result())
            results = [future.result() for future in futures]
    rows = [(step.name, "ok" if ok else "FAIL", figure, seconds)
            for step, (ok, figure, seconds) in zip(steps, results, strict=True)]
    print()
    print(table(rows))
    print(f"\ntotal {time.perf_counter() - started:.1f} s; logs in {ctx.out}", flush=True)
    return 0 if all(status == "ok" for _, status, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
