"""Start N local worker processes through PyTorch's elastic launcher (what ``torchrun`` uses).

When the process already belongs to a launched world (``torchrun`` or SLURM set ``RANK`` and
``WORLD_SIZE``), the function runs directly in it instead.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, SupportsInt

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from plait.cluster.network import is_local_address


def _adopt_slurm_environment() -> None:
    """Map SLURM's task variables to the ones ``torch.distributed`` reads (env:// rendezvous).

    The batch script must export MASTER_ADDR and MASTER_PORT (see docs/launching.md).
    """
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])


def in_launched_world() -> bool:
    """True under torchrun or SLURM (with MASTER_ADDR set): this process is one rank of a world."""
    _adopt_slurm_environment()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def launched_rank() -> int:
    return int(os.environ["RANK"])


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkersFailed(RuntimeError):
    """Local workers ended with a non-zero status; each printed its own reason already."""

    def __init__(self, failures: dict[int, int]) -> None:
        self.failures = failures
        self.status = max(failures.values()) if failures else 1
        ranks = ", ".join(f"rank {r} (exit status {code})" for r, code in sorted(failures.items()))
        super().__init__(f"{ranks} failed; the reason is printed above")


@dataclass(frozen=True)
class Hosts:
    """A multi-host run started by ``plait train --nnodes N --rdzv-endpoint HOST:PORT`` on every host."""

    nnodes: int
    endpoint: str
    run_id: str
    timeout_s: float
    #: the address the other hosts reach this one at (``None``: its host name)
    local_addr: str | None = None


class RendezvousFailed(RuntimeError):
    """The hosts of a multi-host run did not all join its rendezvous in time (or could not reach it)."""


def _rendezvous_message(hosts: Hosts, error: Exception) -> str:
    here = socket.gethostname()
    if isinstance(error, RendezvousConnectionError):
        return (f"cannot reach the rendezvous at {hosts.endpoint} (run id {hosts.run_id!r}) from {here}: {error}; "
                f"check that HOST:PORT is the first host's address and that the port is open between the hosts")
    missing = hosts.nnodes - 1
    return (f"the rendezvous at {hosts.endpoint} (run id {hosts.run_id!r}) did not complete within "
            f"{hosts.timeout_s:g} s (launch.rdzv_timeout_s): {missing} of {hosts.nnodes} hosts never joined "
            f"(joined: this host, {here}). Start `plait train` with the same --nnodes, --rdzv-endpoint and "
            f"--rdzv-id on every host, and check that {hosts.endpoint} is reachable from each (launch.iface)")


class StoppedBySignal(Exception):
    """The launcher received SIGTERM/SIGINT (preemption, Ctrl-C) and the workers have ended: a normal
    end of a run, whose caller reports what the workers saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def launch_local(entrypoint: Callable[..., Any], nproc: int, *args: Any, hosts: Hosts | None = None) -> None:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks with a c10d rendezvous on localhost, or
    with ``hosts``, as this host's share of a multi-host run (the same call on every host).

    Raises :class:`WorkersFailed` when a worker fails: the elastic launcher's own report (a
    traceback of the launcher per failed rank) says nothing the worker did not print;
    :class:`StoppedBySignal` when a stop signal ended the run; and
    :class:`RendezvousFailed` when the hosts do not all join within ``hosts.timeout_s``.
    """
    if in_launched_world():
        entrypoint(*args)
        return
    if hosts is None:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                              monitor_interval=0.5, start_method="spawn")
    else:
        timeout = max(1, round(hosts.timeout_s))
        config = LaunchConfig(min_nodes=hosts.nnodes, max_nodes=hosts.nnodes, nproc_per_node=nproc,
                              run_id=hosts.run_id, rdzv_backend="c10d", rdzv_endpoint=hosts.endpoint,
                              rdzv_configs={"join_timeout": timeout, "timeout": timeout,
                                            "is_host": is_local_address(hosts.endpoint.rsplit(":", 1)[0])},
                              max_restarts=0, local_addr=hosts.local_addr,
                              monitor_interval=0.5, start_method="spawn")
    quiet = CleanStopFilter()
    loggers = [logging.getLogger(name) for name in CleanStopFilter.LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        raise WorkersFailed({rank: int(f.exitcode) for rank, f in e.failures.items()}) from None
    except (RendezvousTimeoutError, RendezvousConnectionError) as e:
        if hosts is None:
            raise
        raise RendezvousFailed(_rendezvous_message(hosts, e)) from None
    except SignalException as e:
        # SIGTERM/SIGINT reached the launcher as well as the workers; workers that were training have
        # written a checkpoint and exited cleanly (see Trainer.fit); the caller says what was saved
        raise StoppedBySignal(int(e.sigval)) from None
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


class CleanStopFilter(logging.Filter):
    """Drops the elastic agent's warnings that only narrate a requested stop, keeps every other one.

    On SIGTERM/SIGINT the agent warns "Received 15 death signal, shutting down workers" and
    "Closing process N via signal SIGTERM" for each worker, although the stop is the normal
    preemption path (each worker checkpoints and exits with status 0). Those two messages are
    dropped, and the second only after the first (the agent also closes workers that way after a
    real failure). A worker that does not stop in time ("Unable to shutdown process ...", then
    SIGKILL), any other death signal, and worker tracebacks still show. The launcher's traceback
    for a worker that exited with the user-error status (2, after printing its one-line reason)
    is dropped too; any other exit status keeps it.
    """

    LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")
    STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
    #: a worker's exit status after it printed a user error (see plait.train.entry)
    USER_ERROR = 2

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args if isinstance(record.args, tuple) else ()
        if isinstance(msg, str) and msg.startswith("failed (exitcode: %s)") and args and args[0] == self.USER_ERROR:
            return False  # the worker printed its one-line reason; the launcher's traceback adds nothing
        if msg == "Received %s death signal, shutting down workers" and args and self._is_stop(args[0]):
            self.stopping = True
            return False
        if self.stopping and msg == "Closing process %s via signal %s" and len(args) == 2:
            return not self._is_stop(args[1])
        return True

    def _is_stop(self, sig: object) -> bool:
        """``sig``: a signal, its number or its name (the agent logs ``Signals.name`` when closing)."""
        if not isinstance(sig, (str, SupportsInt)):
            return False
        try:
            value = signal.Signals[sig] if isinstance(sig, str) else signal.Signals(int(sig))
        except (KeyError, ValueError, TypeError):
            return False
        return value in self.STOP_SIGNALS


#: seconds an orphaned worker has to stop after its SIGTERM before it is ended
ORPHAN_GRACE_S = 60.0


#: exit status of a worker whose host's launcher died in a multi-host run
ORPHANED_STATUS = 5


def exit_when_orphaned(grace_s: float = ORPHAN_GRACE_S, poll_s: float = 1.0) -> threading.Thread:
    """End this worker if its launcher dies (``kill -9`` of ``plait train`` or of ``torchrun``).

    A worker whose launcher is gone is re-parented and, if it waits in a rendezvous or a
    collective, waits forever, holding memory (on GPUs, device memory). A daemon thread watches the
    parent PID: when it changes, the worker gets SIGTERM (during training: the preemption path,
    which checkpoints at the next step boundary) and, if it is still alive ``grace_s`` later, ends.

    In a multi-host run (``GROUP_WORLD_SIZE`` > 1: several launchers) the preemption path would be
    wrong: every rank on every host agrees to stop, so the surviving hosts' launchers would see a
    finished job instead of a lost host. There the worker ends at once (status
    :data:`ORPHANED_STATUS`); the other hosts' ranks fail on the closed connections, and their
    launchers restart them (``torchrun --nnodes MIN:MAX``: at the smaller world size) from the
    newest checkpoint.
    """
    parent = os.getppid()
    several_hosts = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) > 1

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if several_hosts:
            print(f"plait: rank {os.environ.get('RANK', '?')}: this host's launcher died; leaving the run so that "
                  f"the other hosts restart without it", file=sys.stderr, flush=True)
            os._exit(ORPHANED_STATUS)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="plait-orphan-watch", daemon=True)
    thread.start()
    return thread


def init_worker(threads: int = 1) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment; ``(rank, world)``.

    The worker also stops by itself if its launcher dies (:func:`exit_when_orphaned`).
    """
    exit_when_orphaned()

    torch.set_num_threads(threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        # naming the device binds the communicator to it (NCCL otherwise guesses it from the global
        # rank, which hangs when ranks and GPUs are not numbered alike)
        dist.init_process_group(backend, device_id=device, **_attempt_store())
    else:
        dist.init_process_group(backend, **_attempt_store())
    return dist.get_rank(), dist.get_world_size()


def _attempt_store() -> dict:
    """Under an elastic launcher, a store whose keys are private to this restart attempt.

    After a worker dies, the launcher restarts every worker against the same key-value store;
    a restarted rank could then read an address a dead rank of the previous attempt published
    and fail with "Connection refused" (seen with gloo on CPU). Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` keeps each attempt's rendezvous separate.
    """
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env:
        return {}
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Each round has a store of its own (rank 0 serves it on a fresh port), so nothing of an
        # earlier attempt can be read; and the restart counts differ between hosts when one joined
        # later (elastic growth), so a prefix made of them would keep the hosts apart.
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=30))
    prefix = f"plait/attempt-{env['TORCHELASTIC_RESTART_COUNT']}"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}


def finish_worker() -> None:
    """Tear down the process group and leave without running interpreter-exit hooks (gloo can abort there)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_worker_now(status: int = 0) -> None:
    """End a worker process at once (after a stop signal), releasing its multiprocessing resources.

    ``os._exit`` skips interpreter-exit hooks, which a preempted worker must do: the launcher is
    shutting down and would never collect a return value. It also skips multiprocessing's exit
    finalizers, which unregister the named semaphores a process created (tqdm's write lock is
    one) from the launcher's resource tracker; without them the launcher warns of "leaked
    semaphore objects" at exit. Running those finalizers first (what a normal exit does) keeps
    the stop clean without running any other exit hook.
    """
    finish_worker()
    # the multiprocessing part of a normal exit, only that; typeshed omits this private function
    multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
