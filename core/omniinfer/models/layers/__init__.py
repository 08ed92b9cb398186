"""Tensor-parallel-aware building blocks of the models."""
