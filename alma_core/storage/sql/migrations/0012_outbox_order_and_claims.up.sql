-- 0012 the outbox leaves each run's records in order, and two relays never publish one
-- row at the same time.
-- oldest-worker: 8
--
-- claimed_until: a relay claims the rows it is about to publish (until then, or until it
-- marks them published or failed); another relay skips them. A relay that dies holding
-- a claim leaves the rows to the next sweep once the claim runs out.
-- outbox_pending_by_key: what an unpublished row waits for, the earlier unpublished rows
-- of its topic and key (a run's hand-offs, a run's replies), found by index.
-- Additive: workers of earlier releases keep running during a rolling upgrade (their
-- relays neither claim nor wait, as before); the order and the claims hold once every
-- worker runs this release.
ALTER TABLE outbox ADD COLUMN claimed_until timestamptz;
CREATE INDEX outbox_pending_by_key ON outbox (topic, key, id) WHERE published_at IS NULL;
