"""What the command line says when Kafka fails: a refusal of the authorizer is named as
one (BrokerDenied: an ACL to grant), never "cannot reach Kafka ... is the broker
running" (docs/kafka.md, Security); a broker that does not answer is an outage."""

from __future__ import annotations

import pytest
from aiokafka import errors as kafka_errors

from alma_core import errors
from alma_core.cli.common import kafka_unavailable


@pytest.mark.parametrize(
    "refusal",
    [
        kafka_errors.TopicAuthorizationFailedError,
        kafka_errors.ClusterAuthorizationFailedError,
        kafka_errors.GroupAuthorizationFailedError,
    ],
)
def test_a_refusal_is_broker_denied_naming_what_to_grant(
    refusal: type[kafka_errors.KafkaError],
) -> None:
    error = kafka_unavailable("broker:9093", "create topics", refusal())
    assert isinstance(error, errors.BrokerDenied)
    assert "refused to create topics" in error.message
    assert refusal.__name__ in error.message
    assert "alma topics acls" in error.message
    assert "running" not in error.message


def test_an_unanswered_broker_is_an_outage() -> None:
    error = kafka_unavailable("broker:9093", "describe topics", kafka_errors.KafkaConnectionError())
    assert isinstance(error, errors.BrokerUnavailable)
    assert "cannot describe topics at broker:9093" in error.message
