-- 0024 back: the four columns take the server's default_toast_compression again.
ALTER TABLE checkpoints ALTER COLUMN state SET COMPRESSION default;
ALTER TABLE superseded_checkpoints ALTER COLUMN state SET COMPRESSION default;
ALTER TABLE run_events ALTER COLUMN payload SET COMPRESSION default;
ALTER TABLE joins ALTER COLUMN reply SET COMPRESSION default;
