-- Undo 0018.
ALTER TABLE tenant_settings DROP COLUMN IF EXISTS learner;
