-- Undo 0014: the superseded states go; the rebuilt checkpoints stay as they are.
DROP TABLE IF EXISTS superseded_checkpoints;
ALTER TABLE runs DROP COLUMN IF EXISTS projection;
