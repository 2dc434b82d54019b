-- 0025 a run's forks, on its own page: the runs whose first checkpoint names it as
-- where they came from (`alma ui`, `alma runs show`; a fork's lineage is in its first
-- checkpoint's metadata, `forked_from`). Partial: only forks' first checkpoints are
-- in it, so it stays small and costs other writes nothing. Building it reads every
-- checkpoint once while writes to the table wait (docs/operations.md, Upgrade).
-- oldest-worker: 20
CREATE INDEX checkpoints_forks
    ON checkpoints (tenant_id, (metadata->'forked_from'->>'run_id'))
    WHERE seq = 1 AND metadata ? 'forked_from';
