"""Autograd-aware collectives (the Megatron f/g operators and their sequence-parallel pair)."""

from plait.comm.collectives import (
    all_reduce_grad,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scale_grad,
    scatter_to_tp,
)

__all__ = [
    "all_reduce_grad",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scale_grad",
    "scatter_to_tp",
]
