-- 0022 a tenant's own PostgreSQL role (issue 50, item 1: the read path bound to who
-- asks, as the write path is bound to the Kafka principal that produced). A login role
-- mapped here to a tenant (`alma tenants role TENANT ROLE`) and granted alma_tenant
-- reads that tenant's rows and nothing else, whatever tenant its queries name: row-level
-- security on every table that holds a tenant's data, keyed on the session's login
-- role, which a client cannot change (SET ROLE changes current_user, not session_user;
-- SET SESSION AUTHORIZATION needs a superuser). Its only writes: its workflows'
-- reducers, the replay mark of its own dead letters, and the row of its own run that
-- its storage quota refused (dead-letter replay deletes it).
--
-- ALMA's own services run as the owner of these tables (who ran the migrations), which
-- row-level security does not restrict (it is enabled, not forced): nothing changes for
-- them, and no policy is evaluated on their hot path.
-- Additive: workers built for 0020 and 0021 run as the owner and never read the table.
-- oldest-worker: 20
CREATE TABLE tenant_roles (
    role_name  text        PRIMARY KEY,
    tenant_id  text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tenant_roles_tenant ON tenant_roles (tenant_id);

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'alma_tenant') THEN
        CREATE ROLE alma_tenant NOLOGIN;
    END IF;
END
$$;
-- Retrieval reads as alma_reader (SET LOCAL ROLE); a tenant's session may too, and
-- alma_reader's policies below bind it to its own tenant as well.
GRANT alma_reader TO alma_tenant;

-- The tenant of this session's login role: the mapped one; '' for a role that holds
-- alma_tenant's privileges and that no row maps (it reads nothing); NULL for every other
-- role (ALMA's own: a superuser, or the owner, who may hold alma_tenant only as its
-- creator's ADMIN grant, without its privileges). Security definer: a tenant's role
-- cannot read tenant_roles itself. Stable, and used as a scalar subquery below: once
-- per query, not per row.
CREATE FUNCTION alma_session_tenant() RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
AS $$
    SELECT coalesce(
        (SELECT tenant_id FROM public.tenant_roles WHERE role_name = session_user::text),
        CASE WHEN pg_has_role(session_user, 'alma_tenant', 'USAGE')
                  AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = session_user)
             THEN '' END)
$$;

-- The tenant retrieval (alma_reader) reads: the one the transaction set, and for a
-- tenant's session only its own (another named: none).
CREATE FUNCTION alma_reader_tenant() RETURNS text
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, public
AS $$
    SELECT CASE
        WHEN s IS NULL THEN current_setting('alma.tenant_id', true)
        WHEN coalesce(current_setting('alma.tenant_id', true), '') IN ('', s) THEN s
    END
    FROM (SELECT public.alma_session_tenant() AS s) AS session
$$;

ALTER POLICY tenant_isolation ON memories
    USING (tenant_id = (SELECT alma_reader_tenant())
           OR ((SELECT alma_session_tenant()) IS NULL
               AND (SELECT current_setting('alma.all_tenants', true)) = 'on'));
ALTER POLICY tenant_isolation ON workflow_outcomes
    USING (tenant_id = (SELECT alma_reader_tenant())
           OR ((SELECT alma_session_tenant()) IS NULL
               AND (SELECT current_setting('alma.all_tenants', true)) = 'on'));
ALTER POLICY tenant_isolation ON artifact_links
    USING (tenant_id = (SELECT alma_reader_tenant())
           OR ((SELECT alma_session_tenant()) IS NULL
               AND (SELECT current_setting('alma.all_tenants', true)) = 'on'));

-- Every table with a tenant's rows: readable by a tenant's role, its own rows only
-- (tenant_roles too: `alma tenants show` lists its own roles).
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'runs', 'checkpoints', 'run_heads', 'run_events', 'joins', 'dead_letters',
        'reducer_configs', 'graph_checkpoints', 'graph_blobs', 'graph_writes',
        'superseded_checkpoints', 'tenant_settings', 'tenant_storage', 'tenant_roles',
        'memories', 'workflow_outcomes', 'artifact_links']
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('GRANT SELECT ON %I TO alma_tenant', t);
        EXECUTE format(
            'CREATE POLICY tenant_own ON %I FOR SELECT TO alma_tenant '
            'USING (tenant_id = (SELECT alma_session_tenant()))', t);
    END LOOP;
END
$$;
GRANT USAGE ON SCHEMA public TO alma_tenant;
GRANT SELECT ON alma_schema_version TO alma_tenant;

-- Its writes, each on its own rows: its workflows' reducers (AlmaClient.register_reducers)
GRANT INSERT, UPDATE ON reducer_configs TO alma_tenant;
CREATE POLICY tenant_own_insert ON reducer_configs FOR INSERT TO alma_tenant
    WITH CHECK (tenant_id = (SELECT alma_session_tenant()));
CREATE POLICY tenant_own_update ON reducer_configs FOR UPDATE TO alma_tenant
    USING (tenant_id = (SELECT alma_session_tenant()))
    WITH CHECK (tenant_id = (SELECT alma_session_tenant()));
-- the replay mark of its dead letters (alma dlq replay)
GRANT UPDATE (replayed_at) ON dead_letters TO alma_tenant;
CREATE POLICY tenant_own_update ON dead_letters FOR UPDATE TO alma_tenant
    USING (tenant_id = (SELECT alma_session_tenant()))
    WITH CHECK (tenant_id = (SELECT alma_session_tenant()));
-- the row of a run its storage quota refused at its start, which holds nothing (the
-- replay of the run's first letter deletes it so the run begins again)
GRANT DELETE ON runs TO alma_tenant;
CREATE POLICY tenant_own_refused ON runs FOR DELETE TO alma_tenant
    USING (tenant_id = (SELECT alma_session_tenant()) AND status = 'refused'
           AND event_count = 0);
