-- Undo 0025.
DROP INDEX IF EXISTS checkpoints_forks;
