-- Undo 0019.
ALTER TABLE tenant_settings DROP COLUMN IF EXISTS checkpoint_retention_days;
