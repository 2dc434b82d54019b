-- Undo 0009.
DROP INDEX IF EXISTS memories_vectors;
ALTER TABLE memories DROP COLUMN IF EXISTS embedding_half,
    ALTER COLUMN embedding SET STORAGE EXTERNAL;
ALTER POLICY tenant_isolation ON artifact_links
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
ALTER POLICY tenant_isolation ON workflow_outcomes
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
ALTER POLICY tenant_isolation ON memories
    USING (tenant_id = current_setting('alma.tenant_id', true)
           OR current_setting('alma.all_tenants', true) = 'on');
