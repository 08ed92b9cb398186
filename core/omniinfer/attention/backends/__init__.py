"""Attention backends that need nothing but torch (every platform can list them)."""
