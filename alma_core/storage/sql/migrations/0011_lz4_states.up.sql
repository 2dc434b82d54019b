-- 0011 states compressed with lz4 where the server has it.
-- oldest-worker: 8
--
-- A checkpoint's state (and a LangGraph thread's channel blob) over ~2 KB is
-- compressed by TOAST on insert. pglz, the default, is most of what PostgreSQL spends
-- writing one: per row, 241 -> 133 us at 5 KB and 4.1 -> 1.6 ms at 100 KB with lz4
-- (PostgreSQL 15, docs/benchmarks.md). lz4 stores 5 KB of agent text as small and
-- 100 KB ~40 % larger. A server built without lz4 refuses it
-- (feature_not_supported): the columns then stay as they were, and the migration
-- still applies; `ALTER TABLE ... SET COMPRESSION` on a later server with lz4
-- does the same by hand. Only rows written afterwards change: no rewrite, only a
-- brief ACCESS EXCLUSIVE lock on each table for the catalogue update (it waits for
-- the transactions using the table, as every ALTER TABLE does).
DO $$
BEGIN
    ALTER TABLE checkpoints ALTER COLUMN state SET COMPRESSION lz4;
    ALTER TABLE graph_blobs ALTER COLUMN blob SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this PostgreSQL has no lz4: states stay compressed with pglz';
END
$$;
