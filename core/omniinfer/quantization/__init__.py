"""Quantised weights: the formats omniinfer loads (GGUF files; GPTQ, AWQ and compressed-tensors
checkpoints; int8 made at load), how a linear layer holds and applies them, and the torch
reference every platform can fall back to. A platform runs formats natively through kernels it
declares (hookspec `omniinfer_quantization_kernels`). See docs/quantization.md.

Importing this package imports nothing heavy; each module says what it needs."""
