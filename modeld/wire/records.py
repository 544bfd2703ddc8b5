"""Request records between the contract's side and protobuf (``modeld.v1.RequestRecord``).

A record's fields and the message's have the same names (``proto/modeld/v1/modeld.proto``);
the positions that may be unknown (where a prefix diverged, the time to first token) are
``optional`` there and ``None`` here.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from modeld.observe.records import RecordQuery, RequestRecord
from modeld.v1 import modeld_pb2 as pb

__all__ = ["query_from_pb", "query_to_pb", "record_from_pb", "record_to_pb"]

_OPTIONAL = ("diverged_at_token", "diverged_at_byte", "diverged_message", "ttft_ms")
_NAMES = tuple(f.name for f in fields(RequestRecord))


def record_to_pb(record: RequestRecord) -> pb.RequestRecord:
    values: dict[str, Any] = {}
    for name in _NAMES:
        value = getattr(record, name)
        if value is not None:
            values[name] = max(0, value) if isinstance(value, int) and name not in _OPTIONAL else value
    return pb.RequestRecord(**values)


def record_from_pb(msg: pb.RequestRecord) -> RequestRecord:
    values: dict[str, Any] = {}
    for name in _NAMES:
        if name in _OPTIONAL and not msg.HasField(name):
            values[name] = None
        else:
            values[name] = getattr(msg, name)
    return RequestRecord(**values)


def query_to_pb(query: RecordQuery, rid: str = "") -> pb.ListRequestsRequest:
    return pb.ListRequestsRequest(
        job=query.job,
        conversation=query.conversation,
        since=query.since,
        limit=query.limit,
        running=query.running,
        id=rid,
    )


def query_from_pb(msg: pb.ListRequestsRequest) -> tuple[RecordQuery, str]:
    """The query, and the one record's id when the request names one."""
    return (
        RecordQuery(
            job=msg.job,
            conversation=msg.conversation,
            since=msg.since,
            limit=msg.limit or 100,
            running=msg.running,
        ),
        msg.id,
    )
