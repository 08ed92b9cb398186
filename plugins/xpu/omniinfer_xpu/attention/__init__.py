"""The XPU plugin's attention backend: IPEX (Intel's extension, when importable)."""
