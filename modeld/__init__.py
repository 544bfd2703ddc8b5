"""modeld: a local daemon that keeps a coding tool's long, stable prompt prefix warm.

A coding tool keeps a large stable prefix and changes a small suffix each turn; modeld keeps
the prefix's KV cache warm and recomputes only what changed. The contract lives in
:mod:`modeld.contract`, the manifest in :mod:`modeld.manifest`, errors in :mod:`modeld.errors`.
This ``__init__`` stays light: importing :mod:`modeld.contract` (as the runtime client does)
must not pull in grpc, the engine or any native backend.
"""

__version__ = "0.1.0"
