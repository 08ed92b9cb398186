"""The plugin layer: hook specifications, the Platform contract, discovery and selection."""

from omniinfer.platforms.interface import Availability, Platform

__all__ = ["Availability", "Platform"]
