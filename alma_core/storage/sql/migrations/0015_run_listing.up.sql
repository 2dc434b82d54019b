-- 0015 the run inspector's list: a tenant's runs newest first, with or without a
-- status, over hundreds of thousands of runs (`alma ui`, docs/inspector.md).
-- oldest-worker: 8
CREATE INDEX runs_tenant_created ON runs (tenant_id, created_at DESC, run_id DESC);
CREATE INDEX runs_tenant_status_created ON runs (tenant_id, status, created_at DESC, run_id DESC);
