-- 0014 replay to migrate: a run's checkpoints rebuilt under new reducers (`alma replay
-- --apply`) keep their seqs and change their states in place, in one transaction under
-- the run's lock; the states they replace are kept here until retention prunes them.
-- oldest-worker: 8
--
-- runs.projection: how many times the run's checkpoints were rebuilt (0: as written).
-- superseded_checkpoints: each rebuilt checkpoint's state as it was in projection N
-- (the state of seq S in projection N is the row (N', S) with the least N' >= N, else
-- the checkpoint itself). Additive: workers of earlier releases neither set nor read
-- them; run `--apply` once every reader runs this release (earlier readers validate a
-- cached head by its seq only).
ALTER TABLE runs ADD COLUMN projection integer NOT NULL DEFAULT 0;

CREATE TABLE superseded_checkpoints (
    tenant_id     text        NOT NULL,
    run_id        text        NOT NULL,
    projection    integer     NOT NULL,
    seq           bigint      NOT NULL,
    state         jsonb       NOT NULL,
    state_hash    text        NOT NULL,
    size_bytes    integer     NOT NULL,
    superseded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, run_id, projection, seq),
    FOREIGN KEY (tenant_id, run_id) REFERENCES runs (tenant_id, run_id) ON DELETE CASCADE
);
CREATE INDEX superseded_checkpoints_at ON superseded_checkpoints (superseded_at);

DO $$
BEGIN
    ALTER TABLE superseded_checkpoints ALTER COLUMN state SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this PostgreSQL has no lz4: superseded states are compressed with pglz';
END
$$;
