"""The network settings of a multi-host run: which interface gloo and NCCL use.

A host with several interfaces (a management Ethernet, InfiniBand, a container bridge) leaves
gloo and NCCL to pick one, and a wrong pick shows up as a hang or "connection refused" between
hosts. ``launch.iface`` (``--iface``) names the interface for both backends through the
variables they read (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``); a value the user already
exported is left alone only when no knob is set.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping

#: the environment variables each backend reads to choose its interface
IFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def iface_environment(iface: str | None) -> dict[str, str]:
    """The variables that make gloo and NCCL use ``iface`` (none when ``iface`` is ``None``)."""
    return {} if iface is None else {name: iface for name in IFACE_VARIABLES}


def local_interfaces() -> list[str]:
    """The names of this host's network interfaces."""
    return sorted(name for _, name in socket.if_nameindex())


def check_local_iface(iface: str | None, field: str = "launch.iface") -> None:
    """Refuse an interface this host does not have, listing the ones it has (before any process starts)."""
    if iface is None:
        return
    names = local_interfaces()
    if iface not in names:
        raise ValueError(f"{field}={iface!r} is not a network interface of this host ({socket.gethostname()}); "
                         f"its interfaces: {', '.join(names)}")


def apply_iface(iface: str | None, env: MutableMapping[str, str] | None = None) -> None:
    """Export ``iface`` for gloo and NCCL into ``env`` (default: this process, inherited by its workers)."""
    target = os.environ if env is None else env
    target.update(iface_environment(iface))


def is_local_address(host: str) -> bool:
    """True when ``host`` names an address of this host (so this host serves the rendezvous store).

    torchrun's c10d rendezvous recognises the store's host by its host name; an endpoint given as
    the address of a secondary interface (``198.18.0.1`` on ``ib0``) is not recognised, and every
    host then waits for a store nobody serves. Binding a socket succeeds only for a local address.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


#: ioctl request that reads an interface's IPv4 address (Linux)
_SIOCGIFADDR = 0x8915


def iface_address(iface: str) -> str | None:
    """The IPv4 address of interface ``iface`` (``None``: it has none, or this is not Linux).

    A multi-host run advertises it to the other hosts as this host's address: a host name may
    resolve to a loopback address (``127.0.1.1`` in many ``/etc/hosts``), where no other host can
    reach it.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


if __name__ == "__main__":  # ``python -m plait.cluster.network IFACE``: its address (the sbatch script uses it)
    import sys

    found = iface_address(sys.argv[1]) if len(sys.argv) == 2 else None
    if found is None:
        sys.exit(f"usage: python -m plait.cluster.network IFACE (an interface with an IPv4 address): {sys.argv[1:]}")
    print(found)
