-- Undo 0012: relays publish without claims, each row on its own.
DROP INDEX IF EXISTS outbox_pending_by_key;
ALTER TABLE outbox DROP COLUMN IF EXISTS claimed_until;
