"""The backend-neutral session engine (no grpc, no protobuf here)."""

from modeld.engine.core import Engine, EngineDecodeStream, EngineSession, LoadedModel
from modeld.engine.limits import Limits
from modeld.engine.owner import Owner, new_instance_id

__all__ = [
    "Engine",
    "EngineDecodeStream",
    "EngineSession",
    "Limits",
    "LoadedModel",
    "Owner",
    "new_instance_id",
]
