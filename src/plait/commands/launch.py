"""``plait launch slurm|k8s RECIPE [key=value ...] --nodes N --gpus-per-node G [-o FILE]``.

Writes a cluster launch file for a recipe: an sbatch script (``slurm``) or a Kubernetes manifest
with a Kubeflow PyTorchJob (``k8s``). The recipe is validated for the job's world size first; a
bad recipe or option writes nothing. ``-o FILE`` never replaces a file plait did not write.
See docs/launching.md.
"""

from __future__ import annotations

import argparse
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="+", metavar="RECIPE [key=value ...]", help="a recipe file followed by overrides")
    p.add_argument("--nodes", type=int, required=True, help="hosts of the job (the most, for an elastic job)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks (devices) per host")
    p.add_argument("--iface", default=None, help="network interface for gloo and NCCL between hosts "
                                                 "(launch.iface; e.g. ib0)")
    p.add_argument("--rdzv-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds the hosts have to join the rendezvous (launch.rdzv_timeout_s)")
    p.add_argument("--rdzv-port", type=int, default=29500, help="TCP port of the c10d rendezvous (default 29500)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a failure (default 3)")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write here (default: standard output)")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="write a cluster launch file (SLURM sbatch script, Kubernetes PyTorchJob)",
                       description="Write a launch file that runs a recipe on a cluster with torchrun and a c10d "
                                   "rendezvous; it resumes from the newest checkpoint after a requeue or restart.")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    slurm = kinds.add_parser("slurm", help="an sbatch script: srun + torchrun, requeue on preemption")
    _common(slurm)
    slurm.add_argument("--partition", default=None, help="SLURM partition")
    slurm.add_argument("--time", default=None, help="SLURM time limit, e.g. 24:00:00")
    k8s = kinds.add_parser("k8s", help="a Kubeflow PyTorchJob (elastic policy) and a ConfigMap with the recipe")
    _common(k8s)
    k8s.add_argument("--image", required=True, help="container image with plait installed")
    k8s.add_argument("--min-nodes", type=int, default=None,
                     help="fewest hosts the job keeps running with (elastic; needs parallel.dp: null)")
    k8s.add_argument("--pvc", default=None, help="PersistentVolumeClaim mounted at /workspace, the working "
                                                 "directory (run.output_dir must be shared by the pods)")
    k8s.add_argument("--namespace", default=None, help="Kubernetes namespace")
    return p


def run(args) -> int:
    from plait.cluster.files import write_launch_file
    from plait.cluster.k8s import pytorchjob_manifest
    from plait.cluster.slurm import sbatch_script
    from plait.cluster.spec import launch_spec
    from plait.commands.train import split_items
    from plait.config import RecipeError
    from plait.config.problems import problems_text
    from plait.outputs import OutputDirError

    try:
        recipe, overrides = split_items(args.items)
        if recipe is None:
            raise ValueError("give the recipe file first: plait launch KIND RECIPE [key=value ...]")
        if args.iface is not None:
            overrides.append(f"launch.iface={args.iface}")
        if args.rdzv_timeout is not None:
            overrides.append(f"launch.rdzv_timeout_s={args.rdzv_timeout}")
        spec, resolved = launch_spec(recipe, overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                     min_nodes=getattr(args, "min_nodes", None), rdzv_port=args.rdzv_port,
                                     max_restarts=args.max_restarts)
    except RecipeError as e:
        print(f"plait launch: {problems_text(e)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:  # an argument of the command, or a missing recipe file
        print(f"plait launch: {e}", file=sys.stderr)
        return 2
    for warning in resolved.warnings:
        print(f"plait launch: warning: {warning}", file=sys.stderr)
    if spec.save_every == 0:
        print("plait launch: warning: checkpoint.save_every is 0: a restart after a failure starts over (a "
              "preempted job still checkpoints on SIGTERM); set checkpoint.save_every", file=sys.stderr)
    if args.kind == "slurm":
        text = sbatch_script(spec, partition=args.partition, time=args.time)
    else:
        text = pytorchjob_manifest(spec, image=args.image, pvc=args.pvc, namespace=args.namespace)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        path = write_launch_file(args.output, text)
    except OutputDirError as e:
        print(f"plait launch: {e}", file=sys.stderr)
        return 2
    print(f"plait launch: wrote {path} ({spec.nodes} nodes x {spec.gpus_per_node} ranks: {resolved.summary_line()})",
          file=sys.stderr)
    return 0
