"""ALMA Stream for Temporal (``pip install 'alma-stream[temporal]'``): a worker plugin
that turns each activity of a workflow into node lifecycle events of the workflow's
ALMA run, and workflow calls for joins, resume points and the run's outcome.

* :mod:`~alma_core.integrations.temporal.worker`: :class:`AlmaPlugin` (for the
  worker) and :func:`retrieve` (inside an activity);
* :mod:`~alma_core.integrations.temporal.workflow`: what workflow code calls
  (``execute_activity`` with a node name, a branch and a result mapping, ``join``,
  ``resume``, ``set_task``, ``complete``);
* :mod:`~alma_core.integrations.temporal.mapping`: how Temporal's identities map to
  ALMA's (tenant, workflow, run, node, branch, event ids). docs/temporal.md has it all.

Nothing is imported here, so workflow code imports only the workflow side.
"""
