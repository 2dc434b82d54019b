"""Lose any one machine: the cluster of real hosts (network namespaces) and the fault
scenarios run on it (docs/operations.md, "High availability")."""
