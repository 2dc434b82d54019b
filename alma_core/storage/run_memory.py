"""What a checkpointer last wrote of its runs, its partitions' offsets and the reducers
it read: a batch whose every run, partition and workflow is here folds from memory and
takes one round trip, its checked write (:mod:`alma_core.storage.checkpoints`).

Memory is never trusted: the write checks, in its statement, that each partition's
stored offset, each run's row version and each workflow's reducers (their row version,
or their absence) are the ones remembered, and writes nothing otherwise; the batch is
then applied under the runs' locks and memory forgets what it held of them. Pure code,
no I/O: the store fills it after each commit from what it wrote and read back.

Bounded in bytes: each run counts its head states' JSON and :data:`RUN_BYTES` for the
rest (least recently written runs go first); heads whose states were never read (a run
whose events carried whole states) are held without them, and a batch that must fold
into one reads the run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from alma_core.reducers import ReducerConfig
from alma_core.schemas import jsoncodec
from alma_core.sequencing import CheckpointRow, Head, HeadKey, RunKey, RunView
from alma_core.storage.offsets import PartitionKey

WorkflowKey = tuple[str, str]  # (tenant, workflow id)
RUN_BYTES = 512  # what a run held costs beside its states: its row, versions, heads' keys


@dataclass(frozen=True)
class RememberedHead:
    """A branch head: its seq and hash, and its state's JSON where it is known."""

    seq: int
    state_hash: str
    state_json: str | None


@dataclass(frozen=True)
class RememberedRun:
    view: RunView  # as written (``changed`` False)
    version: str  # the row's xmin after the write
    heads: dict[str, RememberedHead]  # by branch key
    states_known: bool  # every head's state is held
    size: int  # bytes it counts: its states' JSON and RUN_BYTES


@dataclass(frozen=True)
class Recalled:
    """What a batch reads, from memory: the runs (copies, for the fold to change), their
    heads, the workflows' reducers, the partitions' stored offsets, and the versions the
    write must find."""

    runs: dict[RunKey, RunView]
    heads: dict[HeadKey, Head]
    configs: dict[WorkflowKey, ReducerConfig]
    stored: dict[PartitionKey, int]
    versions: dict[RunKey, str]
    config_versions: dict[WorkflowKey, str | None]  # None: the workflow has none
    states_known: set[RunKey]  # runs whose every head's state was held


class RunMemory:
    """See the module docstring. ``budget_bytes``: what it holds at most (states' JSON
    and :data:`RUN_BYTES` a run)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._runs: OrderedDict[RunKey, RememberedRun] = OrderedDict()
        self._offsets: dict[PartitionKey, int] = {}
        self._configs: dict[WorkflowKey, tuple[ReducerConfig | None, str | None]] = {}
        self._bytes = 0
        self.recalled = 0  # batches folded from memory
        self.missed = 0  # batches that read instead

    @property
    def size(self) -> int:
        return self._bytes

    def recall(
        self,
        partitions: Iterable[PartitionKey],
        runs: Iterable[RunKey],
        with_state: set[RunKey],
        workflows: Iterable[WorkflowKey],
    ) -> Recalled | None:
        """The batch's reads, if memory holds every one of them; None otherwise."""
        stored: dict[PartitionKey, int] = {}
        for tp in partitions:
            if (offset := self._offsets.get(tp)) is None:
                self.missed += 1
                return None
            stored[tp] = offset
        held: list[RememberedRun] = []
        for key in runs:
            run = self._runs.get(key)
            if run is None or (key in with_state and not run.states_known):
                self.missed += 1
                return None
            held.append(run)
        configs: dict[WorkflowKey, ReducerConfig] = {}
        config_versions: dict[WorkflowKey, str | None] = {}
        for wf in workflows:
            if (known := self._configs.get(wf)) is None:
                self.missed += 1
                return None
            config, version = known
            if config is not None:
                configs[wf] = config
            config_versions[wf] = version
        heads: dict[HeadKey, Head] = {}
        for run in held:
            key = run.view.key
            self._runs.move_to_end(key)
            folds = key in with_state  # as a read: the states only of runs folded into
            for branch, head in run.heads.items():
                held_state = head.state_json if folds else None
                state = jsoncodec.parse(held_state.encode()) if held_state is not None else {}
                heads[(*key, branch)] = Head(head.seq, head.state_hash, state)
        self.recalled += 1
        return Recalled(
            runs={run.view.key: replace(run.view) for run in held},
            heads=heads,
            configs=configs,
            stored=stored,
            versions={run.view.key: run.version for run in held},
            config_versions=config_versions,
            states_known={run.view.key for run in held if run.view.key in with_state},
        )

    def remember(
        self,
        offsets: dict[PartitionKey, int],
        written: Iterable[tuple[RunView, str]],
        read: dict[HeadKey, Head],
        made: dict[HeadKey, CheckpointRow],
        states_known: set[RunKey],
        configs: dict[WorkflowKey, tuple[ReducerConfig | None, str | None]],
        *,
        recalled: bool,
    ) -> None:
        """After a commit: the partitions' stored offsets; each run written, with its
        new row version and its heads: those the batch read (``read``; held as memory
        had them when the batch was ``recalled``), with their states for the runs in
        ``states_known``, then those the batch made (``made``, states included); and
        the workflows' reducers as read, with their row versions."""
        self._offsets.update(offsets)
        self._configs.update(configs)
        before: dict[RunKey, dict[str, RememberedHead]] = {}
        for (tenant, run_id, branch), head in read.items():
            key = (tenant, run_id)
            if (tenant, run_id, branch) in made:
                continue  # the batch's own head replaces it
            if recalled and key in self._runs:
                before[key] = dict(self._runs[key].heads)
                continue
            known = key in states_known
            before.setdefault(key, {})[branch] = RememberedHead(
                head.seq, head.state_hash, jsoncodec.compact(head.state).decode() if known else None
            )
        for (tenant, run_id, branch), row in made.items():
            before.setdefault((tenant, run_id), {})[branch] = RememberedHead(
                row.seq, row.state_hash, row.state_json
            )
        for view, version in written:
            key = view.key
            heads = before.get(key, {})
            size = RUN_BYTES + sum(len(h.state_json or "") for h in heads.values())
            prior = self._runs.get(key) if recalled else None
            known = key in states_known or (prior is not None and prior.states_known)
            self._drop(key)
            self._runs[key] = RememberedRun(
                replace(view, changed=False), version, heads, known, size
            )
            self._bytes += size
        while self._bytes > self.budget_bytes and self._runs:
            self._drop(next(iter(self._runs)))

    def forget(self, runs: Iterable[RunKey] = (), partitions: Iterable[PartitionKey] = ()) -> None:
        """What a failed check, or a partition gone elsewhere, made doubtful."""
        for key in runs:
            self._drop(key)
        for tp in partitions:
            self._offsets.pop(tp, None)
        self._configs.clear()

    def clear(self) -> None:
        self._runs.clear()
        self._offsets.clear()
        self._configs.clear()
        self._bytes = 0

    def _drop(self, key: RunKey) -> None:
        gone = self._runs.pop(key, None)
        if gone is not None:
            self._bytes -= gone.size
