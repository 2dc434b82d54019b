-- 0004 outbox retries: a row that fails to publish (e.g. a reply_to topic that does not
-- exist on a broker with auto-creation off) no longer holds back the rows after it; it
-- is retried with a growing delay, and the last error is kept for the operator.
ALTER TABLE outbox
    ADD COLUMN attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN last_error      text;
