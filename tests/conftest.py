"""Shared test settings: hypothesis profile for a small, shared 2-core machine."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "alma",
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("alma")
