-- Undo 0013: a deleted thread's id stays its graph's.
ALTER TABLE runs DROP COLUMN IF EXISTS released_at;
