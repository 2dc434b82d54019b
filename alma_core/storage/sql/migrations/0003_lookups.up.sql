-- 0003 lookups: the SDK's applied() looks a dead-lettered event up by its id while it
-- waits, and `alma runs show` lists a run's dead letters; both scanned the table.
CREATE INDEX dead_letters_event ON dead_letters (event_id) WHERE event_id IS NOT NULL;
CREATE INDEX dead_letters_run ON dead_letters (run_id) WHERE run_id IS NOT NULL;
