-- 0006 tenant-scoped run identity: a run is (tenant_id, run_id), an event
-- (tenant_id, event_id). Two tenants may use the same run id or event id (an
-- orchestrator names runs per namespace; Temporal's workflow ids are unique per
-- namespace only) without seeing or blocking each other. Every row already carries
-- its tenant; run_heads gets the column from its run.

ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_run_id_fkey;
ALTER TABLE run_heads DROP CONSTRAINT run_heads_run_id_fkey;
ALTER TABLE run_events DROP CONSTRAINT run_events_run_id_fkey;
ALTER TABLE joins DROP CONSTRAINT joins_run_id_fkey;

ALTER TABLE runs DROP CONSTRAINT runs_pkey;
ALTER TABLE runs ADD PRIMARY KEY (tenant_id, run_id);

ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_pkey;
ALTER TABLE checkpoints ADD PRIMARY KEY (tenant_id, run_id, seq);
ALTER TABLE checkpoints ADD CONSTRAINT checkpoints_run_fkey FOREIGN KEY (tenant_id, run_id)
    REFERENCES runs (tenant_id, run_id) ON DELETE CASCADE;
DROP INDEX checkpoints_branch_head;
CREATE INDEX checkpoints_branch_head ON checkpoints (tenant_id, run_id, branch_id, seq DESC);

ALTER TABLE run_heads ADD COLUMN tenant_id text;
UPDATE run_heads h SET tenant_id = r.tenant_id FROM runs r WHERE r.run_id = h.run_id;
ALTER TABLE run_heads ALTER COLUMN tenant_id SET NOT NULL;
ALTER TABLE run_heads DROP CONSTRAINT run_heads_pkey;
ALTER TABLE run_heads ADD PRIMARY KEY (tenant_id, run_id, branch_key);
ALTER TABLE run_heads ADD CONSTRAINT run_heads_run_fkey FOREIGN KEY (tenant_id, run_id)
    REFERENCES runs (tenant_id, run_id) ON DELETE CASCADE;

ALTER TABLE run_events DROP CONSTRAINT run_events_pkey;
ALTER TABLE run_events ADD PRIMARY KEY (tenant_id, event_id);
ALTER TABLE run_events ADD CONSTRAINT run_events_run_fkey FOREIGN KEY (tenant_id, run_id)
    REFERENCES runs (tenant_id, run_id) ON DELETE CASCADE;
DROP INDEX run_events_run;
CREATE INDEX run_events_run ON run_events (tenant_id, run_id, ordinal);

ALTER TABLE joins DROP CONSTRAINT joins_pkey;
ALTER TABLE joins ADD PRIMARY KEY (tenant_id, run_id, join_id);
ALTER TABLE joins ADD CONSTRAINT joins_run_fkey FOREIGN KEY (tenant_id, run_id)
    REFERENCES runs (tenant_id, run_id) ON DELETE CASCADE;

ALTER TABLE workflow_outcomes DROP CONSTRAINT workflow_outcomes_event_id_key;
ALTER TABLE workflow_outcomes ADD CONSTRAINT workflow_outcomes_event_key
    UNIQUE (tenant_id, event_id);
