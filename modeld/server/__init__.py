"""The daemon's two faces and what they share: the gateway both transports meet at
(``gateway.py``: the contract plus observers, the metrics), the one asyncio bridge into the
synchronous engine (``bridge.py``), the gRPC token (``auth.py``), health per model
(``health.py``) and reflection (``reflection.py``); the gRPC servicer (``grpc/``) and the HTTP
APIs (``http/``). ``modeld/daemon.py`` composes them with the engine. Thin: no engine logic here.
"""
