"""Every error ALMA Stream raises on purpose.

    AlmaError
    ├── ConfigError             a setting is missing or wrong (names the variable)
    ├── ContextError            a WorkflowContext breaks the tenant > workflow > run > node rules
    │   └── NotFound            what it names is not there (a run, a checkpoint, a merge)
    ├── RejectedEvent           an event that can never succeed: it goes to the dead letters
    │   ├── ReducerError
    │   │   ├── UnknownReducer
    │   │   ├── ReducerTypeError
    │   │   └── ConflictingUpdate
    │   ├── MissingBranch
    │   ├── RunMovedPastJoin
    │   ├── StateTooLarge
    │   ├── StaleExpectedSeq
    │   ├── EventIdReused
    │   ├── RunCompleted
    │   └── RunPruned
    ├── StorageError            Postgres failed (retriable: back off and try again)
    │   └── StorageRejected     Postgres refused the data itself (not retriable)
    ├── CacheError              Redis failed (retriable; callers fall back to Postgres)
    ├── BrokerUnavailable       Kafka did not answer (retriable: check it runs, try again)
    ├── BrokerDenied            Kafka refused an operation: the principal lacks an ACL
    ├── MergeFailed             a join was answered with status "error"
    ├── MergeTimeout            no reply to a join in time (retriable: same join_id)
    ├── EffectTimeout           an event had no effect in time (retriable)
    ├── MigrationError          the schema cannot be moved to the asked version
    └── StackError              the embedded stack could not start or stop

The class docstring is the default message. ``retriable`` tells a consumer
whether to back off and retry the batch (True) or dead-letter the event (False);
``reason`` is the stable code written into dead-letter headers and metrics.
"""

from __future__ import annotations


class AlmaError(Exception):
    """ALMA Stream failed."""

    retriable: bool = False
    reason: str = "error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or self.reason).strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class ConfigError(AlmaError):
    """A setting is missing or has a wrong value."""

    reason = "config"


class ContextError(AlmaError):
    """The workflow context is inconsistent."""

    reason = "context"


class InvalidPatch(ContextError):
    """A JSON Patch (RFC 6902) that is not one, or does not apply to the state it was
    given for (a fork's edit): nothing was written."""

    reason = "invalid_patch"


class NotFound(ContextError):
    """What the context names is not there (a run, a checkpoint, a merge): a failure to
    look again for, not wrong usage (the CLI exits 1, not 2)."""

    reason = "not_found"


class RejectedEvent(AlmaError):
    """The event can never be applied; it goes to the dead-letter topic."""

    reason = "rejected"


class ReducerError(RejectedEvent):
    """A reducer could not combine the values it was given."""

    reason = "reducer"


class UnknownReducer(ReducerError):
    """No reducer is registered under this name."""

    reason = "unknown_reducer"


class ReducerTypeError(ReducerError):
    """A reducer was given a value of a type it cannot combine."""

    reason = "reducer_type"


class ConflictingUpdate(ReducerError):
    """Two states wrote different values to a field that has no reducer (strict mode)."""

    reason = "strict_conflict"


class MissingBranch(RejectedEvent):
    """A join names a branch that has no checkpoint in the run."""

    reason = "missing_branch"


class RunMovedPastJoin(RejectedEvent):
    """Checkpoints were added to the run after the join's position before it was merged:
    the merged checkpoint can no longer take the seq after the join."""

    reason = "run_moved_past_join"


class StateTooLarge(RejectedEvent):
    """The state is larger than the configured limit."""

    reason = "state_too_large"


class RecordTooLarge(RejectedEvent):
    """An event's record is over ``ALMA_MAX_RECORD_BYTES``: refused before it is sent."""

    reason = "record_too_large"


class StaleExpectedSeq(RejectedEvent):
    """The run's latest checkpoint sequence is not the one the event expected."""

    reason = "stale_expected_seq"


class EventIdReused(RejectedEvent):
    """Another run already has an event with this event_id: event ids are unique across
    runs (the inbox keeps one effect per id)."""

    reason = "event_id_reused"


class RunCompleted(RejectedEvent):
    """The run is completed (its ``workflow.completed`` applied): it takes no more node
    events or joins. Give new work a new run id; a LangGraph thread goes on (its
    ``graph.*`` events are accepted after ``acomplete``)."""

    reason = "run_completed"


class RunPruned(RejectedEvent):
    """Retention pruned this closed run: it takes no more events (one replayed after its
    inbox row was deleted cannot be told from a new one, so neither is applied)."""

    reason = "run_pruned"


class StorageQuotaExceeded(RejectedEvent):
    """The tenant keeps as many checkpoint bytes as its storage quota allows: a new run
    is refused (its events wait in the dead letters), the runs begun before go on."""

    reason = "storage_quota"


class StorageError(AlmaError):
    """PostgreSQL failed; the operation can be retried."""

    retriable = True
    reason = "storage"


class StorageRejected(StorageError):
    """PostgreSQL refused the data itself; retrying cannot help."""

    retriable = False
    reason = "storage_rejected"


class CacheError(AlmaError):
    """Redis failed; readers fall back to PostgreSQL."""

    retriable = True
    reason = "cache"


class MergeFailed(AlmaError):
    """The join was answered with an error."""

    reason = "merge_failed"


class MergeTimeout(AlmaError):
    """No reply to the join arrived in time; sending it again with the same join_id is safe."""

    retriable = True
    reason = "merge_timeout"


class EffectTimeout(AlmaError):
    """The event had no effect in time: the checkpointer is down or lagging. The event
    is published and may still take effect: ask again with the same event id."""

    retriable = True
    reason = "effect_timeout"


class MigrationError(AlmaError):
    """The database schema cannot be moved to the requested version."""

    reason = "migration"


class BrokerUnavailable(AlmaError):
    """Kafka did not answer; check ALMA_KAFKA_BOOTSTRAP and that the broker runs."""

    retriable = True
    reason = "broker_unavailable"


class BrokerDenied(AlmaError):
    """Kafka refused the operation: the principal lacks an ACL (docs/kafka.md, Security)."""

    reason = "broker_denied"


class StackError(AlmaError):
    """The embedded stack could not be started or stopped."""

    reason = "stack"


def rejection(reason: str, message: str) -> RejectedEvent:
    """The RejectedEvent subclass a dead-letter ``reason`` stands for (the base class
    for reasons of the decoder, such as ``schema_violation``)."""
    todo: list[type[RejectedEvent]] = [RejectedEvent]
    while todo:
        cls = todo.pop()
        if cls.reason == reason:
            return cls(message)
        todo.extend(cls.__subclasses__())
    return RejectedEvent(f"{reason}: {message}")
