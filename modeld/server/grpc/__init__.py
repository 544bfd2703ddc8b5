"""The gRPC face: the servicer (protobuf <-> contract, through the gateway and the bridge)."""
