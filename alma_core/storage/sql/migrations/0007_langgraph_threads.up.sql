-- 0007 LangGraph threads: what a LangGraph checkpointer (alma_core.integrations.langgraph)
-- writes through the pipeline as graph.* events. A thread is a run of its tenant
-- (run_id = thread_id): its events are in run_events like any run's, its checkpoints,
-- channel values (by version) and pending writes here.
CREATE TABLE graph_checkpoints (
    tenant_id            text        NOT NULL,
    thread_id            text        NOT NULL,
    checkpoint_ns        text        NOT NULL DEFAULT '',
    checkpoint_id        text        NOT NULL,
    parent_checkpoint_id text,
    run_id               text,  -- LangGraph's run (metadata.run_id): delete_for_runs
    checkpoint           jsonb       NOT NULL,
    metadata             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, thread_id, checkpoint_ns, checkpoint_id)
);
CREATE INDEX graph_checkpoints_run ON graph_checkpoints (tenant_id, run_id)
    WHERE run_id IS NOT NULL;

-- A channel's value at one version, written once and shared by every checkpoint that
-- holds that version (only the channels a checkpoint changed are written with it).
CREATE TABLE graph_blobs (
    tenant_id     text  NOT NULL,
    thread_id     text  NOT NULL,
    checkpoint_ns text  NOT NULL DEFAULT '',
    channel       text  NOT NULL,
    version       text  NOT NULL,
    type          text  NOT NULL,
    blob          bytea,
    PRIMARY KEY (tenant_id, thread_id, checkpoint_ns, channel, version)
);

-- Pending writes of the tasks of a checkpoint.
CREATE TABLE graph_writes (
    tenant_id     text        NOT NULL,
    thread_id     text        NOT NULL,
    checkpoint_ns text        NOT NULL DEFAULT '',
    checkpoint_id text        NOT NULL,
    task_id       text        NOT NULL,
    idx           integer     NOT NULL,
    channel       text        NOT NULL,
    type          text        NOT NULL,
    blob          bytea,
    task_path     text        NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
);
