-- Undo 0007.
DROP TABLE IF EXISTS graph_writes;
DROP TABLE IF EXISTS graph_blobs;
DROP TABLE IF EXISTS graph_checkpoints;
