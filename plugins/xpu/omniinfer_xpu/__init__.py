"""omniinfer device plugin for XPU. Importing it is free: see `plugin.py` for the hooks."""
