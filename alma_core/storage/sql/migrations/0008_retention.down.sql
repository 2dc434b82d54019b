-- Undo 0008 (runs already pruned stay pruned; they take events again).
DROP INDEX IF EXISTS memories_outcomes_by_age;
DROP INDEX IF EXISTS runs_to_delete;
DROP INDEX IF EXISTS runs_events_to_prune;
DROP INDEX IF EXISTS runs_checkpoints_to_prune;
ALTER TABLE runs DROP COLUMN IF EXISTS events_pruned_at, DROP COLUMN IF EXISTS checkpoints_pruned_at;
