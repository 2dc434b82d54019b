-- Undo 0021.
ALTER TABLE tenant_settings DROP COLUMN IF EXISTS max_state_bytes;
