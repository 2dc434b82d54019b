-- 0013 a LangGraph thread deleted by its graph (adelete_thread, prune "delete") frees
-- its id: another graph of the tenant may take it, as on LangGraph's own savers.
-- oldest-worker: 8
--
-- released_at: when the run's thread was deleted, until its next event (NULL: in use).
-- A graph event of another workflow on a released run takes the run over. Additive:
-- workers of earlier releases neither set nor read it (they keep refusing the reuse).
-- Threads deleted before this release are released now: their graph rows are gone.
ALTER TABLE runs ADD COLUMN released_at timestamptz;
UPDATE runs r SET released_at = r.updated_at
WHERE r.status = 'running'
  AND EXISTS (SELECT 1 FROM run_events e
              WHERE e.tenant_id = r.tenant_id AND e.run_id = r.run_id
                AND e.type = 'graph.upkeep')
  AND NOT EXISTS (SELECT 1 FROM graph_checkpoints g
                  WHERE g.tenant_id = r.tenant_id AND g.thread_id = r.run_id);
