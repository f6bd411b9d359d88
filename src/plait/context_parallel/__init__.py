"""Context parallelism: the sequence of each micro-batch split over the cp ranks (zigzag load
balancing) and attention computed across the split by a ring of K/V blocks or an all-gather."""

from plait.context_parallel.allgather import allgather_attention
from plait.context_parallel.exchange import RingExchange
from plait.context_parallel.plan import Piece, RingStep, causal_work, pieces, ring_plan
from plait.context_parallel.ring import ring_attention
from plait.context_parallel.split import SequenceSplit

__all__ = ["Piece", "RingExchange", "RingStep", "SequenceSplit", "allgather_attention", "causal_work", "pieces",
           "ring_attention", "ring_plan"]
