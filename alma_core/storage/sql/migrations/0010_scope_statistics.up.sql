-- 0010 statistics for the retrieval plan's choice.
-- oldest-worker: 8
--
-- Retrieval picks its plan (exact or HNSW) from the planner's estimate of a scope's
-- rows, not by counting them. A workflow id or an agent belongs to one tenant (or
-- repeats across tenants); without these objects the planner multiplies the two
-- columns' selectivities and estimates a 2,000-memory workflow of a 1M-row table at
-- 40 rows. Functional dependencies correct the product; ANALYZE (or autovacuum's)
-- builds them. No row or index changes: instant.
CREATE STATISTICS memories_tenant_workflow (dependencies) ON tenant_id, workflow_id FROM memories;
CREATE STATISTICS memories_tenant_agent (dependencies) ON tenant_id, agent FROM memories;
CREATE STATISTICS workflow_outcomes_tenant_workflow (dependencies)
    ON tenant_id, workflow_id FROM workflow_outcomes;
