"""omniinfer device plugin for CUDA. Importing it is free: see `plugin.py` for the hooks."""
