"""Observability that every transport shares: metrics (``metrics.py``) and safe log lines
(``logs.py``). Nothing here imports grpc, protobuf, an HTTP framework or the engine."""
