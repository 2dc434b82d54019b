-- 0019 a tenant's own checkpoint retention (issue 50, item 2): the days its closed
-- runs' checkpoints are kept, where it differs from ALMA_CHECKPOINT_RETENTION_DAYS
-- (NULL: the global value; 0: forever). Read by each pruning round (the learner's,
-- `alma db prune`); the other lifetimes stay global.
-- Additive: workers built for 0018 never read the column.
-- oldest-worker: 18
ALTER TABLE tenant_settings ADD COLUMN checkpoint_retention_days double precision
    CHECK (checkpoint_retention_days IS NULL OR checkpoint_retention_days >= 0);
