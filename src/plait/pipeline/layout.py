"""The pipeline split moved to :mod:`plait.plan.pipeline_split` (it builds the family's model, and
the pipeline package sits below the model families). These names stay importable from here until
``train/build_run.py``, ``config/host_memory.py``, ``plan/memory.py`` and ``bench/measure_memory.py``
import them from there; then this module goes.
"""

from plait.plan.pipeline_split import partition_for, plan_partition

__all__ = ["partition_for", "plan_partition"]
