-- 0021 a tenant's own state size limit (issue 50, item 2): the bytes a checkpoint's
-- state of its runs may take, where it is lower than ALMA_MAX_STATE_BYTES (NULL: the
-- global limit, which stays every tenant's ceiling: the decoder, the broker's records
-- and the cache are sized for it). Read by the checkpointer and the joiner every few
-- seconds, so a change takes effect without a restart.
-- Additive: workers built for 0020 never read the column.
-- oldest-worker: 20
ALTER TABLE tenant_settings ADD COLUMN max_state_bytes integer
    CHECK (max_state_bytes IS NULL OR max_state_bytes >= 1024);
