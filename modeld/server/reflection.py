"""Server reflection, v1 as well as v1alpha.

grpcio-reflection ships only ``grpc.reflection.v1alpha``; newer clients (grpcurl, Postman,
grpc-js's reflection) ask ``grpc.reflection.v1`` first. The two protos are the same messages
with the same field numbers under another package name, so one servicer answers both: the v1
method is registered with the v1alpha message classes (the bytes are identical), and a
renamed copy of the v1alpha file descriptor is added to the default pool so a v1 client can
reflect on the reflection service itself.

What not: a second implementation of reflection; no generated v1 code is committed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

__all__ = ["V1ALPHA_SERVICE", "V1_SERVICE", "enable_reflection", "v1_file_descriptor"]

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_ALPHA = ".grpc.reflection.v1alpha."
_V1 = ".grpc.reflection.v1."
_lock = threading.Lock()
_added = False


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``grpc/reflection/v1/reflection.proto``, made from the v1alpha descriptor by renaming."""
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        for f in message.field:
            if f.type_name.startswith(_ALPHA):
                f.type_name = _V1 + f.type_name[len(_ALPHA) :]
    for service in fdp.service:
        for method in service.method:
            method.input_type = _V1 + method.input_type[len(_ALPHA) :]
            method.output_type = _V1 + method.output_type[len(_ALPHA) :]
    return fdp


def _add_v1_to_default_pool() -> None:
    global _added
    with _lock:
        if _added:
            return
        pool = descriptor_pool.Default()
        try:
            pool.FindServiceByName(V1_SERVICE)
        except KeyError:
            pool.Add(v1_file_descriptor())
        _added = True


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) for ``service_names`` and the reflection services, on
    an asyncio server."""
    _add_v1_to_default_pool()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1ALPHA_SERVICE, V1_SERVICE))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),)
    )
