"""Data parallelism owned by plait: flat gradient buffers, bucketed overlapped reduction, ZeRO-1."""

from plait.data_parallel.grad_sync import GradSync
from plait.data_parallel.layout import Bucket, BufferLayout, ParamEntry, Segment, plan_buffer
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper

__all__ = ["BufferLayout", "Bucket", "DistributedOptimizer", "GradSync", "OptimizerHyper", "ParamEntry", "Segment",
           "plan_buffer"]
