"""The ROCm plugin's attention backend: ROCM_FLASH (Triton / CK flash attention)."""
