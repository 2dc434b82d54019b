-- 0008 retention of every table that grows with traffic.
-- A closed run is pruned in steps, each recorded on its row: its checkpoints, then
-- its event log and stored join replies, last the row itself (LangGraph threads are
-- left to LangGraph's adelete_thread and aprune). Once a step touched a run it takes no more
-- events: an event replayed after its inbox row is gone is refused (run_pruned), not
-- applied again. Partial indexes keep each step's search to the runs it has left.
ALTER TABLE runs
    ADD COLUMN checkpoints_pruned_at timestamptz,
    ADD COLUMN events_pruned_at      timestamptz;
CREATE INDEX runs_checkpoints_to_prune ON runs (completed_at)
    WHERE completed_at IS NOT NULL AND checkpoints_pruned_at IS NULL;
CREATE INDEX runs_events_to_prune ON runs (completed_at)
    WHERE completed_at IS NOT NULL AND events_pruned_at IS NULL;
CREATE INDEX runs_to_delete ON runs (completed_at)
    WHERE checkpoints_pruned_at IS NOT NULL AND events_pruned_at IS NOT NULL;

-- Node-outcome memories (the learner's raw record of each failed node) age out;
-- heuristics and anti-patterns are counted from workflow_outcomes, which stay.
CREATE INDEX memories_outcomes_by_age ON memories (created_at) WHERE kind = 'outcome';

-- dead_letters_created (created_at DESC) already serves its pruning.
