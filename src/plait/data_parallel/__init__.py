"""Data parallelism owned by plait: flat gradient buffers, bucketed overlapped reduction, ZeRO-1."""

from plait.data_parallel.buckets import Bucket, BucketPlan, ParamEntry, Segment, plan_buckets
from plait.data_parallel.grad_sync import GradSync
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper

__all__ = ["Bucket", "BucketPlan", "DistributedOptimizer", "GradSync", "OptimizerHyper", "ParamEntry", "Segment",
           "plan_buckets"]
