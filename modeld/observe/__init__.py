"""What modeld reports about itself and its machine: the status types and the engine's events
(``status.py``), the views people read (``views.py``), hardware inventory (``hardware.py``),
where the memory goes (``memory.py``), metrics (``metrics.py``), request records (``records.py``:
one per turn; ``recordfile.py``: their file; ``turns.py``: what a session's turn adds to its
record beside each metric; ``requests.py``: their views) and safe log lines (``logs.py``),
shared by every transport.

Nothing here imports an engine, grpc, protobuf or an HTTP framework: the server turns these
values into messages.
"""
