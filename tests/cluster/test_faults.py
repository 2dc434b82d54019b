"""Guarantee 10, the short form CI runs: every kind of fault once on a cluster of real
hosts (network namespaces: three Kafka brokers, PostgreSQL and Redis, two worker hosts,
an orchestrator host), each scenario ending with every acknowledged event applied
exactly once, gapless seqs, every join merged once where its reply said and answered,
the cache equal to PostgreSQL or absent, and no dead letter; a PostgreSQL failover that
lost commits (asynchronous replication) has them applied again from Kafka, and no read
returns a state PostgreSQL no longer has. ``make faults`` runs the long form and prints
the report's table."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.cluster.__main__ import cells
from tests.cluster.cluster import Cluster, cluster
from tests.cluster.scenarios import NO_JOINS, SCENARIOS, run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
async def hosts(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async with cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_losing_a_machine_loses_nothing(hosts: Cluster, scenario: str) -> None:
    outcome = await run(hosts, scenario)
    print(" · ".join(cells(outcome)))
    verdict = outcome.verdict
    assert verdict.acknowledged > 0
    # runs fanned out and joined through the fault (but where a failover loses commits)
    assert verdict.joins > 0 or scenario in NO_JOINS
    assert verdict.problems == []
    assert (verdict.lost, verdict.doubled, verdict.dead_letters) == (0, 0, 0)
    assert verdict.applied == verdict.acknowledged == verdict.on_topic
    assert outcome.flowing_after_s is not None, "no checkpoint after the fault healed"
    assert outcome.served_newer == 0, "a read returned a state PostgreSQL no longer has"
    if scenario == "postgres primary lost, asynchronous":
        # the failover lost committed checkpoints with their offsets: each was applied
        # again from Kafka (the repair this scenario exists to prove)
        assert outcome.rolled_back > 0
        # the cache held states the new primary had lost, and no reader was served them
        assert outcome.cache_ahead > 0
    if scenario == "worker cut off from kafka":
        assert outcome.readiness == (503, 200)  # not ready without brokers, ready with them
        # the worker back from the cut takes its partitions back with new connections:
        # one through the cut waited for TCP's retransmission (11-26 s after the heal)
        assert verdict.longest_wait_after_heal_s < 5, outcome
    if scenario == "worker killed":
        # the other worker never stopped: no rebalance waited out the dead member's
        # session (ALMA_GROUP_INSTANCE_ID), so checkpoints never paused for long
        assert outcome.stalled_s < 2.5, outcome
    if scenario == "cache cut off":
        # the pipeline goes on without the cache (each call given up after 0.5 s; its
        # longest pause 0.5-2.7 s): had it waited for Redis, checkpoints would have
        # stopped for the whole 8 s cut
        assert outcome.stalled_s < 6, outcome
    if scenario == "postgres primary lost, synchronous":
        assert outcome.rolled_back == 0
