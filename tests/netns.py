"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Each namespace gets one end of the pair, named :data:`IFACE` in both (so one ``launch.iface``
serves every host, as ``ib0`` does on a real cluster), with an address from the benchmarking
range 198.18.0.0/15 (RFC 2544), which never leaves the namespaces. Processes started in a
namespace run in their own session, so :meth:`TwoHosts.close` can end each started process
group before it deletes the namespaces; close runs whatever happened (a fixture finalizer).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence

IFACE = "plait0"
ADDRESSES = ("198.18.0.1", "198.18.0.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Namespaces ``names[0]`` (address ``ADDRESSES[0]``) and ``names[1]``, joined by a veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = (f"plait-{tag}-a", f"plait-{tag}-b")
        self.processes: list[subprocess.Popen] = []
        self._created: list[str] = []
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self._created.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            ends = (f"pv{tag}a", f"pv{tag}b")
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for end, name, address in zip(ends, self.names, ADDRESSES, strict=True):
                _ip("link", "set", end, "netns", name)
                _ip("-n", name, "link", "set", end, "name", IFACE)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", IFACE)
                _ip("-n", name, "link", "set", IFACE, "up")
        except BaseException:
            self.close()
            raise

    def popen(self, host: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in host ``host``'s namespace (in a session of its own)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        """End every process started here (TERM, then KILL), then delete the namespaces (and the veth pair)."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for name in self._created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._created.clear()


def namespaces_unavailable() -> str | None:
    """Why two namespaces cannot be made here (``None``: they can), tried with a throw-away namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN)"
    name = f"plait-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace: {detail.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None
