-- Undo 0006. Below it a run id and an event id are global: refused while two tenants
-- share one (nothing is deleted to make room; rename or remove those runs first).
DO $$
DECLARE shared text;
BEGIN
    SELECT run_id INTO shared FROM runs GROUP BY run_id HAVING count(*) > 1 LIMIT 1;
    IF shared IS NOT NULL THEN
        RAISE EXCEPTION 'cannot go below migration 6: tenants share the run id %; rename or '
                        'delete those runs first', shared;
    END IF;
    SELECT event_id INTO shared FROM run_events GROUP BY event_id HAVING count(*) > 1 LIMIT 1;
    IF shared IS NOT NULL THEN
        RAISE EXCEPTION 'cannot go below migration 6: tenants share the event id %', shared;
    END IF;
END $$;

ALTER TABLE workflow_outcomes DROP CONSTRAINT workflow_outcomes_event_key;
ALTER TABLE workflow_outcomes ADD UNIQUE (event_id);

ALTER TABLE joins DROP CONSTRAINT joins_run_fkey;
ALTER TABLE joins DROP CONSTRAINT joins_pkey;
ALTER TABLE joins ADD PRIMARY KEY (run_id, join_id);

DROP INDEX run_events_run;
CREATE INDEX run_events_run ON run_events (run_id, ordinal);
ALTER TABLE run_events DROP CONSTRAINT run_events_run_fkey;
ALTER TABLE run_events DROP CONSTRAINT run_events_pkey;
ALTER TABLE run_events ADD PRIMARY KEY (event_id);

ALTER TABLE run_heads DROP CONSTRAINT run_heads_run_fkey;
ALTER TABLE run_heads DROP CONSTRAINT run_heads_pkey;
ALTER TABLE run_heads ADD PRIMARY KEY (run_id, branch_key);
ALTER TABLE run_heads DROP COLUMN tenant_id;

DROP INDEX checkpoints_branch_head;
CREATE INDEX checkpoints_branch_head ON checkpoints (run_id, branch_id, seq DESC);
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_run_fkey;
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_pkey;
ALTER TABLE checkpoints ADD PRIMARY KEY (run_id, seq);

ALTER TABLE runs DROP CONSTRAINT runs_pkey;
ALTER TABLE runs ADD PRIMARY KEY (run_id);

ALTER TABLE checkpoints ADD FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE;
ALTER TABLE run_heads ADD FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE;
ALTER TABLE run_events ADD FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE;
ALTER TABLE joins ADD FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE;
