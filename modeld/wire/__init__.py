"""The wire layer shared by the daemon and the runtime client: protobuf conversion and the
error table. It imports grpc and protobuf, and never the engine or the backends."""
