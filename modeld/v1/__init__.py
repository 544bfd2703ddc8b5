"""Generated protobuf and gRPC code for modeld.v1 (``make proto``). Do not edit."""
