"""Kernels the core ships: portable Triton kernels (``kernels/triton``) that run on NVIDIA, AMD
and Intel GPUs, and on the CPU under Triton's interpreter."""
