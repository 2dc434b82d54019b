-- Undo 0001. The vector extension stays: other schemas may use it.
DROP TABLE IF EXISTS artifact_links;
DROP TABLE IF EXISTS memories;
DROP TABLE IF EXISTS workflow_outcomes;
DROP TABLE IF EXISTS joins;
DROP TABLE IF EXISTS reducer_configs;
DROP TABLE IF EXISTS dead_letters;
DROP TABLE IF EXISTS outbox;
DROP TABLE IF EXISTS consumer_offsets;
DROP TABLE IF EXISTS run_events;
DROP TABLE IF EXISTS run_heads;
DROP TABLE IF EXISTS checkpoints;
DROP TABLE IF EXISTS runs;
