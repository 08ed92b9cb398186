"""omniinfer device plugin for ROCM. Importing it is free: see `plugin.py` for the hooks."""
