"""The sbatch script of ``plait launch slurm``: one ``torchrun`` per node, started by ``srun``.

Why this shape: ``srun`` starts one task per node; each runs ``torchrun`` (PyTorch's elastic
agent), which starts the node's ranks and joins a c10d rendezvous hosted on the allocation's first
node, with the SLURM job id as the rendezvous id (a requeued job keeps its id). Rendezvous and
worker restarts are torchrun's (``--max-restarts``); plait adds:

* the interface gloo and NCCL use between nodes (``launch.iface``);
* the rendezvous timeout (``launch.rdzv_timeout_s``, torchrun's ``join_timeout``);
* preemption and the time limit: ``--requeue`` and ``--signal=B:USR1@SECONDS``; the script's trap
  requeues the job and sends SIGTERM to the job step, every rank writes a checkpoint at its next
  step boundary and exits, and the requeued job resumes from it (``checkpoint.resume=auto``).
  A partition that preempts with ``PreemptMode=REQUEUE`` sends SIGTERM itself; the same trap runs.
"""

from __future__ import annotations

import shlex

from plait.cluster.network import iface_environment
from plait.cluster.spec import MARKER, LaunchSpec

#: seconds before the time limit at which SLURM signals the script (time to write a checkpoint)
SIGNAL_AHEAD_S = 300


def sbatch_script(spec: LaunchSpec, *, partition: str | None = None, time: str | None = None) -> str:
    """The batch script text for ``spec`` (``partition``/``time``: SLURM's ``--partition``/``--time``)."""
    q = shlex.quote
    directives = [f"--job-name={spec.job_name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={spec.gpus_per_node}"]
    if partition is not None:
        directives.append(f"--partition={partition}")
    if time is not None:
        directives.append(f"--time={time}")
    directives += ["--requeue", f"--signal=B:USR1@{SIGNAL_AHEAD_S}", "--open-mode=append", "--output=%x-%j.out"]
    env = iface_environment(spec.iface)
    exports = " ".join(f"{k}={q(v)}" for k, v in env.items())
    lines = [
        "#!/bin/bash",
        f"# {MARKER} slurm` from {spec.recipe}; plait replaces this file only while this line is here.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        f"# One torchrun per node; each starts {spec.gpus_per_node} ranks and joins the c10d rendezvous on the",
        "# allocation's first node. A requeued job keeps its job id, the rendezvous id.",
        "set -euo pipefail",
        "",
        'export PYTHON="${PLAIT_PYTHON:-python}"',
        '# (not `| head -n 1`: under pipefail, scontrol killed by SIGPIPE would end the script)',
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'head_node="${nodes[0]}"',
        f'export RDZV_ENDPOINT="$head_node:{spec.rdzv_port}"',
    ]
    if exports:
        lines.append(f"export {exports} PLAIT_IFACE={q(spec.iface or '')}  # launch.iface")
    else:
        lines.append("# launch.iface is not set: gloo and NCCL choose the interface (set it with --iface)")
    lines += [
        "",
        "# Preemption, or the time limit near (--signal above): requeue the job and stop the ranks with",
        "# SIGTERM; each writes a checkpoint at its next step boundary, and the requeued job resumes",
        "# from it (checkpoint.resume=auto).",
        "srun_pid=",
        "stop_and_requeue() {",
        '    echo "plait: job $SLURM_JOB_ID is stopping; the ranks write a checkpoint and the job is requeued" >&2',
        '    scontrol requeue "$SLURM_JOB_ID" || true',
        '    if [ -n "$srun_pid" ]; then kill -TERM "$srun_pid" 2>/dev/null || true; fi',
        "}",
        "trap stop_and_requeue USR1 TERM",
        "",
        "# Each node's task: node 0 serves the rendezvous store (is_host), and with launch.iface every",
        "# node advertises that interface's address (a host name may resolve to a loopback address).",
        f"srun --kill-on-bad-exit=1 --nodes={spec.nodes} --ntasks-per-node=1 bash -c '",
        "    is_host=false",
        '    if [ "$SLURM_NODEID" = 0 ]; then is_host=true; fi',
        "    local_addr=()",
        '    if [ -n "${PLAIT_IFACE:-}" ]; then',
        '        address="$("$PYTHON" -m plait.cluster.network "$PLAIT_IFACE")"',
        '        local_addr=(--local-addr="$address")',
        "    fi",
        '    exec "$PYTHON" -m torch.distributed.run "${local_addr[@]}" \\',
        f"        --nnodes={spec.nodes} --nproc-per-node={spec.gpus_per_node} \\",
        '        --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$SLURM_JOB_ID" \\',
        f'        --rdzv-conf="join_timeout={spec.rdzv_timeout_s:g},is_host=$is_host" '
        f"--max-restarts={spec.max_restarts} \\",
        '        "$@"\' plait-node \\',
        f"    -m {spec.shell_train_arguments()} &",
        "srun_pid=$!",
        "",
        "# wait returns early when the trap runs; wait again until srun ends, and exit with its status",
        "status=0",
        "while true; do",
        '    wait "$srun_pid" && status=0 || status=$?',
        '    kill -0 "$srun_pid" 2>/dev/null || break',
        "done",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)
