-- 0018 a tenant's learner on or off (issue 50, item 2): NULL follows the global
-- setting (the learner learns from every tenant's finished runs); false: the learner
-- passes the tenant's completions by (no outcome, no memory, nothing embedded), and
-- its earlier memories stay until retention removes them (`alma db prune`).
-- Read by the learner every few seconds, as the rate quota is by the checkpointer.
-- Additive: workers built for 0017 never read the column.
-- oldest-worker: 17
ALTER TABLE tenant_settings ADD COLUMN learner boolean;
