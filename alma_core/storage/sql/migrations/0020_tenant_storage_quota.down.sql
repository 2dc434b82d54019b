-- Undo 0020 (a refused run, which holds nothing, goes with it).
DELETE FROM runs WHERE status = 'refused';
ALTER TABLE runs DROP CONSTRAINT runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('running', 'failed', 'succeeded'));
DROP TABLE IF EXISTS tenant_storage;
ALTER TABLE tenant_settings DROP COLUMN IF EXISTS storage_quota_bytes;
