-- Undo 0022. The alma_tenant role stays (roles belong to the whole cluster and other
-- databases may grant it); only this database's grants and policies are removed.
DROP POLICY IF EXISTS tenant_own_refused ON runs;
REVOKE DELETE ON runs FROM alma_tenant;
DROP POLICY IF EXISTS tenant_own_update ON dead_letters;
REVOKE UPDATE (replayed_at) ON dead_letters FROM alma_tenant;
DROP POLICY IF EXISTS tenant_own_update ON reducer_configs;
DROP POLICY IF EXISTS tenant_own_insert ON reducer_configs;
REVOKE INSERT, UPDATE ON reducer_configs FROM alma_tenant;
REVOKE SELECT ON alma_schema_version FROM alma_tenant;
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'runs', 'checkpoints', 'run_heads', 'run_events', 'joins', 'dead_letters',
        'reducer_configs', 'graph_checkpoints', 'graph_blobs', 'graph_writes',
        'superseded_checkpoints', 'tenant_settings', 'tenant_storage', 'tenant_roles']
    LOOP
        EXECUTE format('DROP POLICY IF EXISTS tenant_own ON %I', t);
        EXECUTE format('REVOKE SELECT ON %I FROM alma_tenant', t);
        EXECUTE format('ALTER TABLE %I DISABLE ROW LEVEL SECURITY', t);
    END LOOP;
    -- the learning tables keep row-level security (0002): only the tenants' policy goes
    FOREACH t IN ARRAY ARRAY['memories', 'workflow_outcomes', 'artifact_links']
    LOOP
        EXECUTE format('DROP POLICY IF EXISTS tenant_own ON %I', t);
        EXECUTE format('REVOKE SELECT ON %I FROM alma_tenant', t);
    END LOOP;
END
$$;
REVOKE USAGE ON SCHEMA public FROM alma_tenant;
ALTER POLICY tenant_isolation ON memories
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');
ALTER POLICY tenant_isolation ON workflow_outcomes
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');
ALTER POLICY tenant_isolation ON artifact_links
    USING (tenant_id = (SELECT current_setting('alma.tenant_id', true))
           OR (SELECT current_setting('alma.all_tenants', true)) = 'on');
DROP FUNCTION IF EXISTS alma_reader_tenant();
DROP FUNCTION IF EXISTS alma_session_tenant();
DROP TABLE IF EXISTS tenant_roles;
