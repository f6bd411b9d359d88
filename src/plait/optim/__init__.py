"""Optimizers that plait owns: AdamW on bf16 weights with stochastic rounding."""
