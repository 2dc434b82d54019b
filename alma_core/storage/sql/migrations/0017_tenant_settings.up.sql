-- 0017 per-tenant settings (issue 50): each tenant's own rate quota, where it differs
-- from the global ALMA_TENANT_RATE / ALMA_TENANT_BURST (NULL: the global value).
-- Written by `alma tenants set` (and the SDK's tenant_settings); the checkpointer reads
-- the table every few seconds, so a change takes effect without a restart.
-- oldest-worker: 16
CREATE TABLE tenant_settings (
    tenant_id text PRIMARY KEY,
    rate_per_s double precision CHECK (rate_per_s IS NULL OR rate_per_s >= 0),
    burst integer CHECK (burst IS NULL OR burst >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);
