"""omniinfer device plugin for CPUs. Importing it is free: see `plugin.py` for the hooks."""
