-- 0016 back: states, payloads and replies in jsonb again (numbers as numeric: -0.0
-- becomes 0, 1e308 a 309-digit integer).
ALTER TABLE checkpoints ALTER COLUMN state TYPE jsonb USING state::jsonb;
ALTER TABLE superseded_checkpoints ALTER COLUMN state TYPE jsonb USING state::jsonb;
ALTER TABLE run_events ALTER COLUMN payload TYPE jsonb USING payload::jsonb;
ALTER TABLE joins ALTER COLUMN reply TYPE jsonb USING reply::jsonb;
