"""The CPU plugin's attention backend: IPEX_CPU (Intel's extension, when importable)."""
