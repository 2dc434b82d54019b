-- Undo 0015.
DROP INDEX IF EXISTS runs_tenant_status_created;
DROP INDEX IF EXISTS runs_tenant_created;
