-- 0009 scoped retrieval at scale (1M memories and more).
-- oldest-worker: 8
--
-- Row-level security read current_setting() once per row it checked (a function call
-- and a text copy: ~0.7 µs a row, half the time of a 20,000-row tenant scan measured
-- at 1M memories). As a scalar subquery it is an InitPlan: read once per query.
ALTER POLICY tenant_isolation ON memories
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');
ALTER POLICY tenant_isolation ON workflow_outcomes
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');
ALTER POLICY tenant_isolation ON artifact_links
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');

-- Broad scopes (a tenant, an agent) are searched exactly from an index alone: a
-- half-precision copy of each embedding (768 bytes instead of 1,536), kept by
-- PostgreSQL, carried in a B-tree keyed by the scope, so the scan reads no table page
-- and half the bytes. Candidates are ranked by it and re-scored with the full vector.
-- The copy is stored out of line and the full vector kept in the row (STORAGE MAIN):
-- with both inline a row passes the 2 KB toast threshold and PostgreSQL would move
-- the larger, the full vector, out of line, adding a TOAST read to every other plan.
-- Adding a stored column rewrites the table (and rebuilds its indexes, HNSW included:
-- ~10 minutes at 1M memories on 2 cores): apply this step in a quiet hour.
-- (halfvec's own storage is EXTERNAL; it is set again by name, in a statement of its
-- own: a STORAGE clause inside ADD COLUMN needs PostgreSQL 16.)
ALTER TABLE memories
    ALTER COLUMN embedding SET STORAGE MAIN,
    ADD COLUMN embedding_half halfvec(384)
        GENERATED ALWAYS AS (embedding::halfvec(384)) STORED;
ALTER TABLE memories ALTER COLUMN embedding_half SET STORAGE EXTERNAL;
CREATE INDEX memories_vectors ON memories (tenant_id, kind, agent)
    INCLUDE (id, embedding_half) WHERE embedding_half IS NOT NULL;
