"""ALMA Stream for LangGraph (``pip install 'alma-stream[langgraph]'``): a checkpoint
saver whose writes go through the pipeline (Kafka, then the checkpointer's exactly-once
batch transaction) and whose reads come from PostgreSQL.

* :class:`AlmaSaver`: LangGraph's ``BaseCheckpointSaver`` (async; sync calls from other
  threads), passing LangGraph's own conformance suite;
* :meth:`AlmaSaver.acomplete`: the thread's outcome, which ALMA learns from.

docs/langgraph.md has it all.
"""

from alma_core.integrations.langgraph.saver import AlmaSaver

__all__ = ["AlmaSaver"]
