"""The CUDA plugin's attention backends: FLASH_ATTN (flash-attn) and XFORMERS (xformers)."""
