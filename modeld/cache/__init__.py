"""Residency: the one owner of "what is warm where" (``blueprints/0014``).

* :mod:`modeld.cache.residency`: per loaded model, the warm contexts in its KV pool, the choice
  of what a turn reuses, eviction, and the leases operations hold;
* :mod:`modeld.cache.tiers`: the daemon-wide RAM and disk tiers of KV snapshots;
* :mod:`modeld.cache.snapfile`: the verified on-disk format of a snapshot;
* :mod:`modeld.cache.ledger`: which KV cells each sequence uses (a shared prefix counts once).

No grpc, protobuf or HTTP here; the engine reaches a runtime only through
``modeld.workers.host.Host``.
"""
