"""Warm state: the one owner of "what is warm where" (``blueprints/0016-warm-state.md``).

* :mod:`modeld.cache.warm`: per loaded model, :class:`~modeld.cache.warm.ModelCache`, which
  chooses, places and makes room for a turn;
* :mod:`modeld.cache.hold`: the :class:`~modeld.cache.hold.Hold` a turn does its KV work through;
* :mod:`modeld.cache.state`: what a model's cache shares with its holds (its pool, its lock,
  its waiters), one public object;
* :mod:`modeld.cache.pool`: the state of one model's KV pool (warm contexts, sessions' slots);
* :mod:`modeld.cache.choice`: what a turn reuses (pure: the longest common token prefix);
* :mod:`modeld.cache.eviction`: which context goes to make room, its prefix saved first;
* :mod:`modeld.cache.reuse`: why a turn was warm, partial or cold (the reasons people read);
* :mod:`modeld.cache.tiers`: the daemon-wide RAM and disk tiers of KV snapshots;
* :mod:`modeld.cache.snapfile`: the verified on-disk format of a snapshot;
* :mod:`modeld.cache.ledger`: which KV cells each sequence uses (a shared prefix counts once);
* :mod:`modeld.cache.runtime`: the protocol the cache reaches a loaded runtime through (copy,
  drop, sync, snapshot, restore), implemented by ``modeld/workers/host.py``.

Imports neither ``modeld.engine`` nor ``modeld.workers``, nor grpc, protobuf or HTTP.
"""
