"""The backend-neutral session engine (no grpc, no protobuf here)."""

from modeld.engine.engine import Engine
from modeld.engine.model import LoadedModel
from modeld.engine.owner import Owner, new_instance_id
from modeld.engine.session import EngineDecodeStream, EngineSession
from modeld.settings import Limits

__all__ = [
    "Engine",
    "EngineDecodeStream",
    "EngineSession",
    "Limits",
    "LoadedModel",
    "Owner",
    "new_instance_id",
]
