-- 0002 learning: what the learner records beside each outcome, per-run node
-- outcomes as memories, indexes for scoped and approximate vector search, and
-- tenant isolation enforced by PostgreSQL for the role the read API uses.

-- The run's strategy (the path of nodes it completed) and, for a failed run,
-- the signature of its error: the learner groups past outcomes by them.
ALTER TABLE workflow_outcomes
    ADD COLUMN strategy        text,
    ADD COLUMN error_signature text;
CREATE INDEX workflow_outcomes_strategy
    ON workflow_outcomes (tenant_id, workflow_id, strategy);
CREATE INDEX workflow_outcomes_error
    ON workflow_outcomes (tenant_id, workflow_id, error_signature)
    WHERE error_signature IS NOT NULL;

-- 'outcome': what one node of one run did (the raw record heuristics and
-- anti-patterns are learned from), scoped to its run and node.
ALTER TABLE memories DROP CONSTRAINT memories_kind_check;
ALTER TABLE memories ADD CONSTRAINT memories_kind_check CHECK (kind IN
    ('heuristic', 'anti_pattern', 'domain_knowledge', 'preference', 'outcome'));
CREATE INDEX memories_run ON memories (tenant_id, run_id, node_id) WHERE run_id IS NOT NULL;

-- Approximate search for broad scopes (a tenant, or everything); selective
-- scopes are searched exactly through the B-tree scope indexes.
CREATE INDEX memories_embedding_hnsw
    ON memories USING hnsw (embedding vector_cosine_ops);
CREATE INDEX workflow_outcomes_embedding_hnsw
    ON workflow_outcomes USING hnsw (embedding vector_cosine_ops);

-- Tenant isolation below the queries: the read API runs as alma_reader with
-- alma.tenant_id set for its transaction, so a query that forgets its tenant
-- filter still sees one tenant's rows. alma.all_tenants = 'on' is set only for
-- the GLOBAL scope, which exists only when multi-tenant mode is off.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'alma_reader') THEN
        CREATE ROLE alma_reader NOLOGIN;
    END IF;
    EXECUTE format('GRANT alma_reader TO %I', current_user);
END
$$;
GRANT USAGE ON SCHEMA public TO alma_reader;
GRANT SELECT ON memories, workflow_outcomes, artifact_links TO alma_reader;

ALTER TABLE memories ENABLE ROW LEVEL SECURITY;
ALTER TABLE workflow_outcomes ENABLE ROW LEVEL SECURITY;
ALTER TABLE artifact_links ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memories FOR SELECT TO alma_reader
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
CREATE POLICY tenant_isolation ON workflow_outcomes FOR SELECT TO alma_reader
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
CREATE POLICY tenant_isolation ON artifact_links FOR SELECT TO alma_reader
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
