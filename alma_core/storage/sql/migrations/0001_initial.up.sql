-- 0001 initial schema: runs, checkpoints, the run event log, consumer
-- bookkeeping, the outbox, dead letters, reducer configurations, joins,
-- workflow outcomes and memories (pgvector) and artifact links.

CREATE EXTENSION IF NOT EXISTS vector;

-- One row per run. last_seq is the gapless checkpoint counter: it is bumped in
-- the same transaction as the checkpoint insert, so a rollback leaves no gap.
CREATE TABLE runs (
    run_id           text        PRIMARY KEY,
    tenant_id        text        NOT NULL,
    workflow_id      text        NOT NULL,
    workflow_version text,
    status           text        NOT NULL DEFAULT 'running'
                     CHECK (status IN ('running', 'failed', 'succeeded')),
    last_seq         bigint      NOT NULL DEFAULT 0 CHECK (last_seq >= 0),
    event_count      bigint      NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz
);
CREATE INDEX runs_tenant_workflow ON runs (tenant_id, workflow_id, created_at DESC);
CREATE INDEX runs_tenant_status ON runs (tenant_id, status, updated_at DESC);
CREATE INDEX runs_completed_at ON runs (completed_at) WHERE completed_at IS NOT NULL;

-- Checkpoints, ordered by seq (1..n, gapless) within a run. branch_id NULL is
-- the run's main line. parent_seq is the previous checkpoint of the same branch
-- (or of the main line); merged_from lists the branch heads a merge folded.
CREATE TABLE checkpoints (
    run_id      text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    seq         bigint      NOT NULL CHECK (seq >= 1),
    tenant_id   text        NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('node', 'failure', 'merge')),
    node_id     text,
    branch_id   text,
    parent_seq  bigint,
    event_id    text        NOT NULL,
    state       jsonb       NOT NULL,
    state_hash  text        NOT NULL,
    size_bytes  integer     NOT NULL CHECK (size_bytes >= 0),
    merged_from bigint[],
    metadata    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX checkpoints_branch_head ON checkpoints (run_id, branch_id, seq DESC);
CREATE INDEX checkpoints_created_at ON checkpoints (created_at);

-- The head of each branch of a run (branch_key '' is the main line): where
-- `updates` fold in, what skip-unchanged compares with, what resume returns.
CREATE TABLE run_heads (
    run_id     text   NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    branch_key text   NOT NULL,
    seq        bigint NOT NULL,
    state_hash text   NOT NULL,
    PRIMARY KEY (run_id, branch_key)
);

-- The run's audit trail and the inbox: one row per accepted event_id, so a
-- re-published event (new offset, same id) has its effect once.
CREATE TABLE run_events (
    event_id       text        PRIMARY KEY,
    ordinal        bigint      GENERATED ALWAYS AS IDENTITY,
    run_id         text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    tenant_id      text        NOT NULL,
    type           text        NOT NULL,
    node_id        text,
    branch_id      text,
    emitted_at     timestamptz NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    checkpoint_seq bigint,
    effect         text        NOT NULL,
    payload        jsonb,
    source_topic   text,
    source_partition integer,
    source_offset  bigint
);
CREATE INDEX run_events_run ON run_events (run_id, ordinal);

-- Offsets of each consumer group, stored in the same transaction as the
-- effects (exactly-once without Kafka transactions). cluster_id keeps offsets
-- of one broker from being applied to another (the embedded broker loses its
-- log on restart). generation fences a zombie member's late writes.
CREATE TABLE consumer_offsets (
    group_id    text        NOT NULL,
    cluster_id  text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    generation  integer     NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, cluster_id, topic, partition)
);

-- Records to publish after the transaction that made them commits: hand-offs
-- to the joiner and learner, merge replies, dead letters.
CREATE TABLE outbox (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic        text        NOT NULL,
    key          bytea,
    value        bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '[]'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;

-- Dead letters, kept for `alma dlq list` and `alma dlq replay`.
CREATE TABLE dead_letters (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer         text        NOT NULL,
    reason           text        NOT NULL,
    detail           text        NOT NULL,
    event_id         text,
    run_id           text,
    tenant_id        text,
    source_topic     text        NOT NULL,
    source_partition integer     NOT NULL,
    source_offset    bigint      NOT NULL,
    key              bytea,
    value            bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    replayed_at      timestamptz,
    UNIQUE (consumer, source_topic, source_partition, source_offset)
);
CREATE INDEX dead_letters_created ON dead_letters (created_at DESC);
CREATE INDEX dead_letters_tenant ON dead_letters (tenant_id, created_at DESC);

-- Reducer configuration registered per workflow ahead of time.
CREATE TABLE reducer_configs (
    tenant_id   text        NOT NULL,
    workflow_id text        NOT NULL,
    config      jsonb       NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workflow_id)
);

-- One row per join request: its merged checkpoint and the exact reply sent.
CREATE TABLE joins (
    run_id         text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    join_id        text        NOT NULL,
    tenant_id      text        NOT NULL,
    event_id       text        NOT NULL,
    status         text        NOT NULL CHECK (status IN ('ok', 'error')),
    checkpoint_seq bigint,
    reply          jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, join_id)
);

-- Outcomes of finished runs, with an embedding of their description.
CREATE TABLE workflow_outcomes (
    id                  uuid        PRIMARY KEY,
    tenant_id           text        NOT NULL,
    workflow_id         text        NOT NULL,
    workflow_version    text,
    run_id              text        NOT NULL,
    event_id            text        NOT NULL UNIQUE,
    success             boolean     NOT NULL,
    duration_ms         bigint      NOT NULL CHECK (duration_ms >= 0),
    node_count          integer     NOT NULL,
    nodes_succeeded     integer     NOT NULL,
    nodes_failed        integer     NOT NULL,
    error_message       text,
    failing_node        text,
    task                text,
    description         text        NOT NULL,
    learnings_extracted integer     NOT NULL DEFAULT 0,
    embedding           vector(384),
    metadata            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, run_id)
);
CREATE INDEX workflow_outcomes_scope ON workflow_outcomes (tenant_id, workflow_id, created_at DESC);

-- Memories: heuristics, anti-patterns, domain knowledge, preferences, with the
-- scope columns retrieval filters on. dedupe_key makes learning idempotent.
CREATE TABLE memories (
    id           uuid        PRIMARY KEY,
    tenant_id    text        NOT NULL,
    kind         text        NOT NULL
                 CHECK (kind IN ('heuristic', 'anti_pattern', 'domain_knowledge', 'preference')),
    agent        text,
    workflow_id  text,
    run_id       text,
    node_id      text,
    content      text        NOT NULL,
    condition    text,
    strategy     text,
    occurrences  integer     NOT NULL DEFAULT 1 CHECK (occurrences >= 0),
    successes    integer     NOT NULL DEFAULT 0 CHECK (successes >= 0),
    confidence   real        NOT NULL DEFAULT 0 CHECK (confidence BETWEEN 0 AND 1),
    dedupe_key   text        NOT NULL,
    embedding    vector(384),
    metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, kind, dedupe_key)
);
CREATE INDEX memories_scope ON memories (tenant_id, workflow_id, run_id, node_id);
CREATE INDEX memories_agent ON memories (tenant_id, agent);

-- Artifacts (kept in blob storage) linked to outcomes and memories.
CREATE TABLE artifact_links (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     text        NOT NULL,
    owner_type    text        NOT NULL CHECK (owner_type IN ('outcome', 'memory')),
    owner_id      uuid        NOT NULL,
    artifact_id   text        NOT NULL,
    artifact_type text        NOT NULL,
    storage_path  text        NOT NULL,
    content_hash  text        NOT NULL,
    size_bytes    bigint      NOT NULL CHECK (size_bytes >= 0),
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (owner_type, owner_id, artifact_id)
);
CREATE INDEX artifact_links_tenant ON artifact_links (tenant_id, artifact_id);
