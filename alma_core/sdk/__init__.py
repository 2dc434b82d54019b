"""The orchestrator's side: the client that publishes lifecycle events and reads
checkpoints and memories, merge replies, workflow hooks, run state, and a small
series-parallel DAG runner. Framework adapters live in ``alma_core.integrations``."""
