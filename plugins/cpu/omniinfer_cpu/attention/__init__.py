"""The CPU plugin's attention backends: IPEX_CPU (Intel's extension, when importable) and
CPU_PAGED (the plugin's compiled kernel)."""
