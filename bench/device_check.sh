#!/usr/bin/env bash
# plait's device check on a machine with one CUDA GPU: the CUDA tests, bench/cuda_smoke.py,
# bench_single in bf16 on a 1.1B Llama (MFU against the measured matmul peak), compiled vs eager,
# the MoE grouped matmul, and CUDA peak memory against the planner's estimate; one table, under
# 8 minutes. Exit status 0 when every step is ok.
#
#   bash bench/device_check.sh              # on the GPU machine
#   bash bench/device_check.sh --dry-run    # the same steps on the CPU at toy sizes (well under a minute)
#   bash bench/device_check.sh --only moe,memory --out /tmp/check
#
# Python: $PYTHON if set, else the repository's .venv, else python3 (plait's requirements
# installed; src/ is put on PYTHONPATH, so plait itself need not be). See bench/device_check.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "$root/bench/device_check.py" "$@"
