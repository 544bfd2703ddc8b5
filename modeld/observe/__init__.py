"""What modeld reports about itself and its machine (hardware inventory, metrics).

Nothing here imports an engine, grpc or protobuf: the server turns these values into messages.
"""
