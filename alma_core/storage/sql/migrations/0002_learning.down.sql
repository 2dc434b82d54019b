-- Undo 0002. The alma_reader role stays: roles belong to the whole cluster and
-- other databases may grant it; only this database's grants are revoked.
DROP POLICY IF EXISTS tenant_isolation ON artifact_links;
DROP POLICY IF EXISTS tenant_isolation ON workflow_outcomes;
DROP POLICY IF EXISTS tenant_isolation ON memories;
ALTER TABLE artifact_links DISABLE ROW LEVEL SECURITY;
ALTER TABLE workflow_outcomes DISABLE ROW LEVEL SECURITY;
ALTER TABLE memories DISABLE ROW LEVEL SECURITY;
REVOKE SELECT ON memories, workflow_outcomes, artifact_links FROM alma_reader;
REVOKE USAGE ON SCHEMA public FROM alma_reader;

DROP INDEX IF EXISTS workflow_outcomes_embedding_hnsw;
DROP INDEX IF EXISTS memories_embedding_hnsw;
DROP INDEX IF EXISTS memories_run;

DELETE FROM memories WHERE kind = 'outcome';
ALTER TABLE memories DROP CONSTRAINT memories_kind_check;
ALTER TABLE memories ADD CONSTRAINT memories_kind_check CHECK (kind IN
    ('heuristic', 'anti_pattern', 'domain_knowledge', 'preference'));

DROP INDEX IF EXISTS workflow_outcomes_error;
DROP INDEX IF EXISTS workflow_outcomes_strategy;
ALTER TABLE workflow_outcomes DROP COLUMN error_signature, DROP COLUMN strategy;
