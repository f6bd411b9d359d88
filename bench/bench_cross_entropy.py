"""Time and peak memory of the vocab-parallel cross-entropy (forward + backward), one process.

What is measured, for fp32 and bf16 logits ``[tokens, vocab]`` (default 4 x 512 tokens and a
16384 vocabulary, the ~80M config of issue 15's table): wall time of ``loss.sum().backward()``
through :func:`plait.tensor_parallel.vocab_parallel_cross_entropy` (TP=1), and the peak memory it
adds on top of the logits (the kernel's peak RSS, ``VmHWM`` after ``clear_refs``, minus the RSS
before the call, measured in a child process in which glibc returns every freed block over
64 KiB, so the RSS follows the live tensors; timing runs in this process with glibc's defaults,
because unmapping on every free makes small multi-threaded operators pay TLB shoot-downs).
Contestants, run interleaved (``--rounds`` rounds, the median is reported):

CPU time (all threads of the process) is reported next to wall time: on a shared, loaded machine
it is the steadier of the two.

* ``plait``: the default chunking (:func:`plait.tensor_parallel.cross_entropy.default_chunk_rows`: 1 MiB
  chunks with one thread, 64 MiB with more);
* ``plait 1 chunk``: ``chunk_rows`` = all tokens (the same arithmetic without chunking);
* ``F.cross_entropy``: ``torch.nn.functional.cross_entropy(logits.float(), target)``, what the
  un-parallelised output module does;
* ``--compare-with FILE``: another implementation of ``vocab_parallel_cross_entropy`` loaded from a
  file, e.g. the one before chunking:
  ``git show 00e3cf6:src/plait/tensor_parallel/cross_entropy.py > /tmp/ce_before.py``.

Run (from the repository root, venv active)::

    python bench/bench_cross_entropy.py
    python bench/bench_cross_entropy.py --compare-with /tmp/ce_before.py --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.cross_entropy import default_chunk_rows, vocab_parallel_cross_entropy

#: glibc: serve blocks over 64 KiB with mmap and unmap them on free, so the RSS tracks live tensors
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_extra_bytes(fn: Callable[[], None]) -> int:
    """Peak RSS during ``fn()`` above the RSS before it (Linux: VmHWM after a clear_refs reset)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    fn()
    return _status("VmHWM:") - before


def _load(path: str) -> Callable:
    spec = importlib.util.spec_from_file_location("ce_compare", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.vocab_parallel_cross_entropy


def _run(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> None:
    fn(logits).sum().backward()
    logits.grad = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--compare-with", metavar="FILE", help="another cross_entropy.py to compare")
    parser.add_argument("--chunks", default="", help="comma-separated chunk_rows values to add as contestants")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n, v = args.tokens, args.vocab
    tp = GroupInfo.single()
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    contestants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "plait": lambda x: vocab_parallel_cross_entropy(x, target, v, tp),
        "plait 1 chunk": lambda x: vocab_parallel_cross_entropy(x, target, v, tp, chunk_rows=n),
        "F.cross_entropy": lambda x: F.cross_entropy(x.float(), target, reduction="none"),
    }
    for rows in filter(None, args.chunks.split(",")):
        contestants[f"plait chunk_rows={int(rows)}"] = lambda x, r=int(rows): vocab_parallel_cross_entropy(
            x, target, v, tp, chunk_rows=r)
    if args.compare_with:
        other = _load(args.compare_with)
        contestants["compared file"] = lambda x: other(x, target, v, tp)
    dtypes = (torch.float32, torch.bfloat16)
    if args.memory_only:
        out = {}
        for dtype in dtypes:
            logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
            for name, fn in contestants.items():
                _run(fn, logits)  # warm-up
                out[f"{dtype} {name}"] = peak_extra_bytes(lambda fn=fn, x=logits: _run(fn, x))
        print(json.dumps(out))
        return
    child = subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--memory-only"],
                           env={**os.environ, MMAP_ENV: "65536"}, capture_output=True, text=True, check=True)
    peaks = json.loads(child.stdout.strip().splitlines()[-1])
    load = os.getloadavg()[0]
    print(f"cross-entropy forward + backward, {n} tokens x vocab {v}, TP=1, {torch.get_num_threads()} threads, "
          f"plait chunk {default_chunk_rows(v, 'cpu')} rows; torch {torch.__version__}; load average {load:.1f} on "
          f"{os.cpu_count()} cores" + (" (BUSY: times unreliable)" if load > (os.cpu_count() or 1) else ""))
    print("| dtype | implementation | ms (median) | ms range | CPU ms (median) | peak MiB above the logits | "
          "logits MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in dtypes:
        logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
        times: dict[str, list[float]] = {k: [] for k in contestants}
        cpu: dict[str, list[float]] = {k: [] for k in contestants}
        for fn in contestants.values():
            _run(fn, logits)  # warm-up
        for r in range(args.rounds):
            order = list(contestants) if r % 2 == 0 else list(contestants)[::-1]
            for name in order:
                t0, c0 = time.perf_counter(), time.process_time()
                _run(contestants[name], logits)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        for name in contestants:
            ms = [1e3 * t for t in times[name]]
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {statistics.median(ms):.1f} | "
                  f"{min(ms):.1f}-{max(ms):.1f} | {1e3 * statistics.median(cpu[name]):.1f} | "
                  f"{peaks[f'{dtype} {name}'] / 2**20:.0f} | {logits.nbytes / 2**20:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
