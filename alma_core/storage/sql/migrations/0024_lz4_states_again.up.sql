-- 0024 states compressed with lz4 again where the server has it.
-- oldest-worker: 20
--
-- 0016 made the state, payload and reply columns `json`, and a column whose type
-- changes loses its compression setting: on a server built with lz4 the checkpoints'
-- (and superseded checkpoints') states went back to pglz after 0011 and 0014 had set
-- lz4 (found on Debian's PostgreSQL 15; the embedded server has no lz4, so the tests
-- there could not see it). Writing a 5 KB state cost 241 µs with pglz, 133 with lz4
-- (as jsonb, on 15: docs/benchmarks.md); a checkpointer draining 5 KB states carried
-- 3,583 checkpoints/s with lz4 against 3,252 with pglz (docs/benchmarks.md, "Where issue
-- 54 stands"). The event payloads and join replies, which hold what users send
-- as well, take lz4 too. A server built without lz4 refuses it (feature_not_supported):
-- the columns then stay as they are and the migration still applies. Only rows written
-- afterwards change: no rewrite, only a brief ACCESS EXCLUSIVE lock on each table for
-- the catalogue update.
DO $$
BEGIN
    ALTER TABLE checkpoints ALTER COLUMN state SET COMPRESSION lz4;
    ALTER TABLE superseded_checkpoints ALTER COLUMN state SET COMPRESSION lz4;
    ALTER TABLE run_events ALTER COLUMN payload SET COMPRESSION lz4;
    ALTER TABLE joins ALTER COLUMN reply SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this PostgreSQL has no lz4: states stay compressed with pglz';
END
$$;
