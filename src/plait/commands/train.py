"""``plait train [RECIPE] [--nproc N] [key.sub=value ...]``.

Started plainly, it validates the recipe, prepares the data once, and launches N local ranks
through PyTorch's elastic launcher. Started under ``torchrun`` (or SLURM, with MASTER_ADDR and
MASTER_PORT set), it joins that world instead. A bad recipe is rejected before any process or
process group starts.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="train a model from a recipe (no recipe: the built-in Shakespeare default)",
        description="Train from a YAML recipe. With no recipe, the built-in default: a small Llama on "
                    "Shakespeare with tensor parallelism over 2 processes. Overrides take the form "
                    "section.field=value, e.g. parallel.tp=2 optimizer.lr=1e-3.",
        epilog="Outputs go to run.output_dir: metrics.jsonl, tensorboard/, loss.png, summary.txt, "
               "sample.txt, recipe.yaml and final/ (a Hugging Face directory). Multi-node: "
               "torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
               "-m plait.cli train RECIPE (see docs/launching.md).")
    p.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]",
                   help="an optional recipe file followed by overrides")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to launch (default: tp*pp*dp*cp of the recipe, dp=1 when unset); "
                        "ignored under torchrun/SLURM, where the world size comes from the launcher")
    net = p.add_argument_group("several hosts (see docs/launching.md)")
    net.add_argument("--nnodes", type=int, default=1,
                     help="hosts of the run; run the same command on each, with --nproc ranks per host")
    net.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="c10d rendezvous of a multi-host run: the first host's address and a free port")
    net.add_argument("--rdzv-id", default="plait", help="rendezvous id, the same on every host (default: plait)")
    net.add_argument("--iface", default=None, help="network interface gloo and NCCL use (launch.iface)")
    net.add_argument("--rdzv-timeout", type=float, default=None, metavar="SECONDS",
                     help="seconds the hosts have to join the rendezvous (launch.rdzv_timeout_s)")
    return p


def network_overrides(args) -> list[str]:
    """The recipe overrides the network options stand for (``--iface``, ``--rdzv-timeout``)."""
    out = []
    if getattr(args, "iface", None) is not None:
        out.append(f"launch.iface={args.iface}")
    if getattr(args, "rdzv_timeout", None) is not None:
        out.append(f"launch.rdzv_timeout_s={args.rdzv_timeout}")
    return out


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """``(recipe path or None, overrides)``; the recipe, if any, is the first item without '='."""
    recipe = None
    if items and "=" not in items[0]:
        recipe, items = items[0], items[1:]
    bad = [i for i in items if "=" not in i]
    if bad:
        raise ValueError(f"override {bad[0]!r} is not of the form section.field=value")
    return recipe, items


def default_nproc(data: dict) -> int:
    """tp * pp * dp * cp of raw recipe data (dp = 1 when unset); bad values are left to validation."""
    p = data.get("parallel") or {}
    degrees = [p.get("tp", 1), p.get("pp", 1), p.get("dp") or 1, p.get("cp", 1)]
    n = 1
    for d in degrees:
        n *= d if isinstance(d, int) and d > 0 else 1
    return n


def _check_endpoint(endpoint: str) -> None:
    """``HOST:PORT`` with a port in 1..65535 and a host name this machine resolves, before any process
    starts (an unresolvable host would otherwise retry inside the rendezvous until its timeout)."""
    import socket

    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint={endpoint!r} must be HOST:PORT, e.g. node001:29400 (the first host's "
                         f"address and a free port)")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as e:
        raise ValueError(f"--rdzv-endpoint={endpoint!r}: the host {host!r} does not resolve on this machine ({e}); "
                         f"give the first host's name or address") from None


def run(args) -> int:
    from plait.config import RecipeError, recipe_data, validate_recipe
    from plait.config.load import DEFAULT_RECIPE
    from plait.config.problems import problems_text
    from plait.launch import in_launched_world, launched_rank, launched_world_size

    layout = None
    try:
        recipe_path, overrides = split_items(args.items)
        overrides += network_overrides(args)
        data = recipe_data(recipe_path or DEFAULT_RECIPE, overrides)
        nnodes = getattr(args, "nnodes", 1)
        if nnodes < 1 or (nnodes > 1 and not getattr(args, "rdzv_endpoint", None)):
            raise ValueError(f"--nnodes={nnodes} needs a positive count and, above 1, --rdzv-endpoint HOST:PORT "
                             f"(the first host's address)")
        if nnodes == 1:  # the rendezvous options act only between several hosts started by plait train
            given = [f"{flag}={value}" for flag, value, unset in (
                ("--rdzv-endpoint", getattr(args, "rdzv_endpoint", None), None),
                ("--rdzv-id", getattr(args, "rdzv_id", "plait"), "plait"),
                ("--rdzv-timeout", getattr(args, "rdzv_timeout", None), None)) if value != unset]
            if given:
                raise ValueError(f"{' '.join(given)} {'is' if len(given) == 1 else 'are'} for a run over several "
                                 f"hosts and need{'s' if len(given) == 1 else ''} --nnodes N (the number of hosts); "
                                 f"drop {'it' if len(given) == 1 else 'them'} to train on this host alone")
        if nnodes > 1:
            _check_endpoint(args.rdzv_endpoint)
        if in_launched_world():
            world = launched_world_size()
            from plait.cluster.elastic import fit_to_world

            data, note = fit_to_world(data, world)  # an elastic restart: dp follows the world, the global batch stays
            if note is not None and launched_rank() == 0:
                print(f"plait train: {note}", flush=True)
        elif nnodes > 1:
            if args.nproc is None:
                raise ValueError(f"--nnodes={nnodes} needs --nproc, the ranks per host")
            world = nnodes * args.nproc
        else:
            world = args.nproc if args.nproc is not None else default_nproc(data)
            if world < 1:
                raise ValueError(f"--nproc={world} must be a positive integer")
            from plait.config.resolve import default_layout_for

            layout = default_layout_for(recipe_path, overrides, args.nproc)
            if layout is not None:  # the built-in default follows --nproc; a user's recipe keeps its layout
                data = recipe_data(DEFAULT_RECIPE, overrides + layout.overrides())
        resolved = validate_recipe(data, world)  # type errors and cross-field rules reported together
    except RecipeError as e:
        print(f"plait train: {problems_text(e)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 2
    if layout is not None:  # said once the recipe is checked
        print(f"plait train: {layout.describe()}", flush=True)
    for warning in resolved.warnings:
        print(f"plait train: warning: {warning}", file=sys.stderr)
    from plait.cluster.network import apply_iface, check_local_iface

    try:
        check_local_iface(resolved.recipe.launch.iface)
    except ValueError as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 2
    apply_iface(resolved.recipe.launch.iface)  # read by gloo/NCCL here (torchrun) or in the ranks started below
    from plait.checkpoint.contents import check_resumable, resume_target
    from plait.checkpoint.format import CheckpointError
    from plait.checkpoint.preflight import claim_outputs
    from plait.outputs import OutputDirError
    from plait.outputs.undo import missing_roots, remove_new_bookkeeping, remove_untouched, unmarked

    try:
        resumed = resume_target(resolved.recipe, resolved.save_dir)
        if resumed is not None:  # what the checkpoint holds, against the recipe, from its manifest alone
            check_resumable(resumed, resolved.recipe)
        created = missing_roots([resolved.output_dir, resolved.save_dir, resolved.checkpoint_dir])
        existing = unmarked([resolved.output_dir, resolved.save_dir])
        # Held until this process ends: the launcher here, global rank 0 under torchrun/SLURM.
        # (several hosts started by plait train: no host knows it holds rank 0 before the rendezvous)
        locks = claim_outputs(resolved, lock=(not in_launched_world() and nnodes == 1)
                              or (in_launched_world() and launched_rank() == 0))
    except (OutputDirError, CheckpointError) as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 2
    hosts = None
    if nnodes > 1 and not in_launched_world():
        from plait.cluster.network import iface_address
        from plait.launch import Hosts

        iface = resolved.recipe.launch.iface
        hosts = Hosts(nnodes, args.rdzv_endpoint, args.rdzv_id, resolved.recipe.launch.rdzv_timeout_s,
                      local_addr=iface_address(iface) if iface else None)
    launched = False
    try:
        if not in_launched_world() and hosts is None:  # else the ranks prepare it, global rank 0 first
            status = _prepare(resolved)
            if status:
                return status
            print(f"launching {world} process(es): {resolved.summary_line()}", flush=True)
        launched = True
        return _launch(resolved, data, world, hosts)
    finally:
        for lock in locks:
            lock.release()
        if not launched:  # refused before any rank started: the directories it created go again, and
            remove_untouched(created)  # the ones that existed lose the marker and lock it left in them
            remove_new_bookkeeping([d for d in existing if d.is_dir()])


def _prepare(resolved) -> int:
    """Prepare the data once, in the parent, before any rank starts; an exit status on failure."""
    from plait.train.entry import prepare_data
    from plait.train.reference_precompute import check_reference_storable

    r = resolved.recipe
    try:
        prepared = prepare_data(r, progress=True)
        if r.preference.reference_mode(r.train.objective, r.lora.rank) == "precompute":
            check_reference_storable(r, prepared)
    except ValueError as e:  # DataError (source, prepared data, seq_len, vocabulary) or ModelConfigError
        print(f"plait train: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or directory of the recipe's that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"plait train: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _launch(resolved, data: dict, world: int, hosts=None) -> int:
    """Start the ranks (this host's share of them with ``hosts``) and report how they ended."""
    from plait.checkpoint.store import latest_checkpoint
    from plait.config.load import dump_recipe_text
    from plait.launch import RendezvousFailed, StoppedBySignal, WorkersFailed, launch_local
    from plait.train.entry import train_worker

    # The ranks receive the recipe as the user wrote it (file + overrides) and validate it again
    # for their world; defaults are not frozen in, so fields that come from model.hf_path stay free.
    text = dump_recipe_text(data)  # read back by the ranks with the recipe loader's own YAML 1.2 rules
    if hosts is not None:
        print(f"joining the rendezvous at {hosts.endpoint} (run id {hosts.run_id!r}) with {world // hosts.nnodes} "
              f"of {world} process(es), {hosts.nnodes} hosts: {resolved.summary_line()}", flush=True)
    nproc = world if hosts is None else world // hosts.nnodes
    try:
        launch_local(train_worker, nproc, text, hosts=hosts)
    except WorkersFailed as e:
        print(f"plait train: {e}", file=sys.stderr)
        return e.status
    except RendezvousFailed as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 1
    except StoppedBySignal as e:
        latest = latest_checkpoint(resolved.save_dir)
        saved = (f"the latest complete checkpoint is {latest} (continue with checkpoint.resume=auto)"
                 if latest is not None else "no checkpoint was saved")
        print(f"plait: stopped by signal {e.signum}; {saved}", flush=True)
    return 0
