"""Shared helper that runs a module-level worker function on N gloo ranks (CPU).

Each rank runs with one thread (forked from a server that imported torch and plait once),
initialises gloo on a free port, calls ``worker(rank, world, *args)``, and reports the returned
value (anything picklable) or its traceback back to the parent through a queue. Workers end with
``destroy_process_group()`` and ``os._exit(0)`` because gloo processes can abort at interpreter
exit otherwise.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Ranks are forked from a server process that imported torch and plait once: spawning each rank
#: anew re-imported them, about 3 s per call. A forked rank starts from the server's environment
#: and working directory, so :func:`run_distributed` hands it the caller's (as spawning did).
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "plait.train.trainer"])


def _entry(rank: int, world: int, port: int, worker: Callable, args: tuple, queue, environ: dict[str, str],
           cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = worker(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must not travel as shared-memory handles
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            queue.close()
            queue.join_thread()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def run_distributed(worker: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``worker`` on ``world`` ranks and return the per-rank results (rank order)."""
    queue = _CONTEXT.Queue()
    port = free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [_CONTEXT.Process(target=_entry, args=(r, world, port, worker, args, queue, environ, cwd))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def init_mesh(world: int, rank: int, **degrees):
    from plait.mesh import ParallelMesh

    return ParallelMesh(world, rank, **degrees)
