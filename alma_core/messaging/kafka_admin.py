"""What an operator's tools ask of Apache Kafka beyond topics: SCRAM users and ACLs,
granted and taken away at run time (``alma up --secure``, ``alma tenants add`` and
``remove``). aiokafka's admin client has no calls for them, but its protocol layer has
the ACL requests and the types a flexible request needs; AlterUserScramCredentials
(KIP-554, API key 51) is written here from Kafka's own schema
(``clients/src/main/resources/common/message/AlterUserScramCredentialsRequest.json``).

The password never travels: the client salts and hashes it (RFC 5802's ``Hi``, PBKDF2
with HMAC-SHA-512) and sends the salted password, from which the controller derives
the stored and server keys, as ``kafka-configs.sh --add-config SCRAM-SHA-512=[...]``
does.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.admin import CreateAclsRequest, DeleteAclsRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from alma_core.messaging import kafka
from alma_core.messaging.acls import Acl
from alma_core.settings import Settings

SCRAM_SHA_512 = 2  # Kafka's ScramMechanism id
SCRAM_ITERATIONS = 8192  # Kafka's minimum for SHA-512 is 4096, its tools' default 4096

# Kafka's enums (org.apache.kafka.common.acl / resource)
_ANY = 1
_RESOURCE = {"topic": 2, "group": 3}
_PATTERN = {False: 3, True: 4}  # LITERAL, PREFIXED
_OPERATION = {"READ": 3, "WRITE": 4, "DESCRIBE": 8, "DESCRIBE_CONFIGS": 10}
_ALLOW = 3


class _AlterScramResponse(Response):  # type: ignore[misc]  # aiokafka is untyped
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            CompactArray(
                ("user", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScramStruct(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponse
    SCHEMA = Schema(
        (
            "deletions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("tags", TaggedFields),
            ),
        ),
        (
            "upsertions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("iterations", Int32),
                ("salt", CompactBytes),
                ("salted_password", CompactBytes),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScram(Request[_AlterScramStruct]):  # type: ignore[misc]
    API_KEY = 51

    def __init__(self, upsertions: list[Any]) -> None:
        self._upsertions = upsertions

    def build(self, request_struct_class: type[_AlterScramStruct]) -> _AlterScramStruct:
        # no deletions, ever: deleting a credential breaks SCRAM sign-ins after a restart
        # on Kafka 4.3.1 (docs/kafka.md); a tenant removed has its credential disabled
        return request_struct_class([], self._upsertions, {})


@contextlib.asynccontextmanager
async def connected(bootstrap: str, s: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client on ``bootstrap`` with ``s``'s credentials, closed after."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **kafka.client_options(s)
    )
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


def salted(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> bytes:
    """SCRAM-SHA-512's salted password (RFC 5802 ``Hi``: PBKDF2-HMAC-SHA-512)."""
    return hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


async def _alter_scram(admin: AIOKafkaAdminClient, upsertions: list[Any]) -> None:
    response = await admin._send_to_controller(_AlterScram(upsertions))
    for user, code, message, _ in response.results:
        if code:
            raise for_code(code)(f"SCRAM credentials of {user!r}: {message}")


async def set_scram_password(admin: AIOKafkaAdminClient, user: str, password: str) -> None:
    """Create ``user``'s SCRAM-SHA-512 credential, or replace its password."""
    salt = secrets.token_bytes(32)
    upsert: tuple[Any, ...] = (
        user,
        SCRAM_SHA_512,
        SCRAM_ITERATIONS,
        salt,
        salted(password, salt),
        {},
    )
    await _alter_scram(admin, [upsert])


async def disable_scram(admin: AIOKafkaAdminClient, user: str) -> None:
    """Take ``user``'s sign-in away: its SCRAM-SHA-512 password replaced by a random one
    that nobody is told. Not a deletion: on Apache Kafka 4.3.1 (one node, broker and
    controller in one process, its first users stored at format) a deleted SCRAM
    credential made every SCRAM sign-in fail once the broker restarted, ALMA's own
    principals' included, whichever client deleted it (aiokafka here, librdkafka too:
    docs/kafka.md)."""
    await set_scram_password(admin, user, secrets.token_urlsafe(48))


async def grant(admin: AIOKafkaAdminClient, principal: str, acls: Sequence[Acl]) -> None:
    """Allow ``principal`` (``User:NAME``) each of ``acls``, from any host (creating an
    ACL that exists already changes nothing)."""
    for acl in acls:
        request = CreateAclsRequest(
            _RESOURCE[acl.kind],
            acl.name,
            _PATTERN[acl.prefixed],
            principal,
            "*",
            _OPERATION[acl.operation],
            _ALLOW,
        )
        response = await admin._send_request(request)
        for code, message in response.creation_responses:
            if code:
                raise for_code(code)(f"{acl.operation} on {acl.kind} {acl.name!r}: {message}")


async def revoke_all(admin: AIOKafkaAdminClient, principal: str) -> int:
    """Delete every ACL of ``principal``; how many there were."""
    request = DeleteAclsRequest(_ANY, None, _ANY, principal, None, _ANY, _ANY)
    response = await admin._send_request(request)
    removed = 0
    for code, message, matching in response.filter_responses:
        if code:
            raise for_code(code)(f"the ACLs of {principal}: {message}")
        removed += len(matching)
    return removed
