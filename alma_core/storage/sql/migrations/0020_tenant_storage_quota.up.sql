-- 0020 a tenant's storage quota (issue 50, item 3): the bytes of checkpoint states it
-- may keep (`storage_quota_bytes`, NULL: ALMA_TENANT_STORAGE_QUOTA_BYTES; 0: none), and
-- what each tenant keeps, counted as it is written: `tenant_storage` holds each
-- tenant's bytes in slots (the writing backend's pid modulo 64, so that two batches
-- of one tenant seldom wait on one row), added to by every statement that writes or
-- rewrites checkpoints and taken from by every one that deletes them; a tenant's use
-- is the sum of its slots. A new run of a tenant at or over its quota is refused: its
-- run row is marked `refused`, its events dead-lettered (storage_quota) until a replay
-- reopens it.
-- Not additive: a worker built before would write checkpoints without counting them,
-- or apply a refused run's events.
-- oldest-worker: 20
ALTER TABLE tenant_settings ADD COLUMN storage_quota_bytes bigint
    CHECK (storage_quota_bytes IS NULL OR storage_quota_bytes >= 0);

CREATE TABLE tenant_storage (
    tenant_id text   NOT NULL,
    slot      int    NOT NULL,
    bytes     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, slot)
);

INSERT INTO tenant_storage (tenant_id, slot, bytes)
SELECT tenant_id, 0, sum(size_bytes) FROM checkpoints GROUP BY tenant_id;

ALTER TABLE runs DROP CONSTRAINT runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('running', 'failed', 'succeeded', 'refused'));
