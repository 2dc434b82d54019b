-- Undo 0010.
DROP STATISTICS IF EXISTS workflow_outcomes_tenant_workflow;
DROP STATISTICS IF EXISTS memories_tenant_agent;
DROP STATISTICS IF EXISTS memories_tenant_workflow;
