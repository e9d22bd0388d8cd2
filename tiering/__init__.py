"""tierd's engine: tiers, catalog, policy, mover and the GPU data path, usable as a library."""

__version__ = "0.1.0"
