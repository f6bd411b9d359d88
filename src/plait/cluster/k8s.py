"""The Kubernetes manifest of ``plait launch k8s``: a ConfigMap holding the recipe and a Kubeflow
``PyTorchJob`` with an elastic policy.

Why this shape: the Kubeflow training operator runs one pod per node and, with ``elasticPolicy``,
passes the rendezvous settings to ``torchrun`` through its ``PET_*`` variables (nodes
``min:max``, c10d rendezvous on the first worker's service, restarts), so the container command
is plain ``torchrun -m plait.cli train``. The recipe travels inside the manifest (a ConfigMap
mounted at :data:`RECIPE_MOUNT`), so the job runs exactly the recipe that was validated here.
Every pod resumes from the newest checkpoint (``checkpoint.resume=auto``), so ``run.output_dir``
must be on storage all pods share (``--pvc``).
"""

from __future__ import annotations

from typing import Any

import yaml

from plait.cluster.network import iface_environment
from plait.cluster.spec import MARKER, LaunchSpec

RECIPE_MOUNT = "/etc/plait"
RECIPE_FILE = "recipe.yaml"
WORKSPACE = "/workspace"
#: torch 2.13 shares the rendezvous store with the workers by default; a rank 0 that stays then never
#: republishes its address for a node that joins at a later restart, which waits for it and times out
#: (growing an elastic job). Not sharing gives every round a store of its own.
ELASTIC_ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class _ManifestDumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (the recipe) as literal blocks, readable in the manifest."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _string)


def pytorchjob_manifest(spec: LaunchSpec, *, image: str, pvc: str | None = None, namespace: str | None = None) -> str:
    """The manifest text (two YAML documents: the recipe's ConfigMap and the PyTorchJob)."""
    meta: dict[str, Any] = {"name": spec.job_name}
    if namespace is not None:
        meta["namespace"] = namespace
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{spec.job_name}-recipe"},
                  "data": {RECIPE_FILE: spec.recipe_text}}
    env = [{"name": k, "value": v} for k, v in iface_environment(spec.iface).items()]
    if spec.elastic:  # a pod that joins later must find the rendezvous (see ELASTIC_ENVIRONMENT)
        env += [{"name": k, "value": v} for k, v in ELASTIC_ENVIRONMENT.items()]
    mounts = [{"name": "recipe", "mountPath": RECIPE_MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "recipe", "configMap": {"name": f"{spec.job_name}-recipe"}}]
    if pvc is not None:
        mounts.append({"name": "workspace", "mountPath": WORKSPACE})
        volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": pvc}})
    # the recipe in the ConfigMap already holds the overrides and checkpoint.resume=auto
    container: dict[str, Any] = {
        "name": "pytorch", "image": image, "workingDir": WORKSPACE,
        "command": ["torchrun", "-m", "plait.cli", "train", f"{RECIPE_MOUNT}/{RECIPE_FILE}"],
        "resources": {"limits": {"nvidia.com/gpu": spec.gpus_per_node}},
        "volumeMounts": mounts,
    }
    if env:
        container["env"] = env
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "rdzvPort": spec.rdzv_port, "minReplicas": spec.min_nodes,
                              "maxReplicas": spec.nodes, "maxRestarts": spec.max_restarts,
                              "rdzvConf": [{"key": "join_timeout", "value": f"{spec.rdzv_timeout_s:g}"}]},
            "nprocPerNode": str(spec.gpus_per_node),
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": spec.nodes, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container], "volumes": volumes}},
            }},
        },
    }
    header = (f"# {MARKER} k8s` from {spec.recipe}; plait replaces this file only while this line is here.\n"
              f"# {spec.nodes} pods (at least {spec.min_nodes}) x {spec.gpus_per_node} GPUs; run.output_dir must be "
              f"on storage every pod shares.\n")
    docs = [yaml.dump(d, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False)
            for d in (config_map, job)]
    return header + "---\n" + "---\n".join(docs)
