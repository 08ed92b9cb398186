"""Quantized weights: the checkpoint formats core reads and how a linear layer holds them.

Importing this package imports nothing heavy; each module says what it needs.
"""
