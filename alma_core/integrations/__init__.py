"""Adapters to the frameworks ALMA Stream's users run, each an optional extra:
:mod:`alma_core.integrations.temporal` (``alma-stream[temporal]``)."""
