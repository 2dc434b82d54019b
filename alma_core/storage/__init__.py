"""Every PostgreSQL and Redis edge of ALMA Stream, one module per table group, with
its SQL beside it and the numbered migrations in ``sql/migrations/``.

Stores have one shape: load what a batch needs, decide in the pure core
(``alma_core.sequencing``, ``joining``, ``learning``), write per batch. Errors are
raised as ``errors.StorageError`` (retriable) or ``errors.StorageRejected`` (this
record, not the server)."""
