"""The ALMA Stream event contract (version 1): pydantic models and a decoder."""

from alma_core.schemas.decoder import Decoded, Rejection, RejectReason, decode
from alma_core.schemas.events import (
    CONTRACT_VERSION,
    ArtifactRef,
    BranchJoin,
    Event,
    EventType,
    MergeReply,
    NodeCompleted,
    NodeFailed,
    NodeStarted,
    WorkflowCompleted,
    encode,
)

__all__ = [
    "CONTRACT_VERSION",
    "ArtifactRef",
    "BranchJoin",
    "Decoded",
    "Event",
    "EventType",
    "MergeReply",
    "NodeCompleted",
    "NodeFailed",
    "NodeStarted",
    "RejectReason",
    "Rejection",
    "WorkflowCompleted",
    "decode",
    "encode",
]
