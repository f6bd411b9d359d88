"""``plait train``'s multi-host options are checked before any process starts: ``--nnodes`` needs
an endpoint and ``--nproc``, ``--iface`` must name an interface of this host; the network helpers."""

from __future__ import annotations

import os

import pytest

from plait.cli import main
from plait.cluster.network import iface_address, iface_environment, is_local_address, local_interfaces


def test_nnodes_needs_an_endpoint_and_ranks_per_host(capsys, tmp_path):
    out = f"run.output_dir={tmp_path / 'run'}"
    assert main(["train", "--nnodes", "2", "--nproc", "2", out]) == 2
    assert "--nnodes=2 needs a positive count and, above 1, --rdzv-endpoint HOST:PORT" in capsys.readouterr().err
    assert main(["train", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", out]) == 2
    assert "--nnodes=2 needs --nproc, the ranks per host" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_interface_this_host_lacks_is_refused_listing_its_interfaces(capsys, tmp_path):
    before = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    assert main(["train", "--iface", "nosuch0", f"run.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "launch.iface='nosuch0' is not a network interface of this host" in err and "lo" in err, err
    assert {k: os.environ.get(k) for k in before} == before  # nothing exported for a refused run
    assert not (tmp_path / "run").exists()


def test_network_helpers():
    assert iface_environment("ib0") == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert iface_environment(None) == {}
    assert "lo" in local_interfaces()
    assert iface_address("lo") == "127.0.0.1" and iface_address("nosuch0") is None
    assert is_local_address("127.0.0.1") and not is_local_address("198.51.100.7")  # TEST-NET-2: never local


@pytest.mark.parametrize("endpoint, expected", [("foo", "must be HOST:PORT"), ("foo:0", "must be HOST:PORT"),
                                                ("nosuchhost.invalid:29400", "does not resolve")])
def test_a_bad_rendezvous_endpoint_is_refused_before_launch(capsys, endpoint, expected):
    """An endpoint without a port, or whose host does not resolve, is an error before any process
    starts (not a rendezvous that retries until its timeout)."""
    assert main(["train", "--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", endpoint, "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "--rdzv-endpoint" in err and expected in err, err
