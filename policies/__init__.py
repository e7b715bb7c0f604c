"""Eviction and prefetch policies: one per file, one registry (policies.registry)."""
