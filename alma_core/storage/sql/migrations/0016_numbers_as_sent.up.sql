-- 0016 every JSON number comes back as it was sent (issue 51, item 1): the columns that
-- hold what users send (states, event payloads, join replies) become `json`, which
-- keeps the text as written. `jsonb` stores numbers as `numeric`: -0.0 came back as 0,
-- 1e308 as a 309-digit integer, so a state read from PostgreSQL differed from the one
-- hashed, cached and replied, and `alma replay` reported a difference that was not there.
-- Queries inside these columns use `->` and `->>` only, which `json` has too.
--
-- Not additive: it admits only workers built for it (no oldest-worker line), as the
-- learner of earlier schemas asked `payload ? 'error'`, a jsonb-only operator. It comes
-- before the first release (0.1.0), so no released worker is turned away.
-- Rewrites the four tables under an ACCESS EXCLUSIVE lock: writes to them wait until
-- it ends (docs/operations.md, "Rolling upgrades", gives the time it took here).
-- Values already stored keep jsonb's rendering.
ALTER TABLE checkpoints ALTER COLUMN state TYPE json USING state::json;
ALTER TABLE superseded_checkpoints ALTER COLUMN state TYPE json USING state::json;
ALTER TABLE run_events ALTER COLUMN payload TYPE json USING payload::json;
ALTER TABLE joins ALTER COLUMN reply TYPE json USING reply::json;
