"""How the KV layer names the model whose KV a pool holds.

A page of one model's KV means nothing to another model with the same shapes, so every pool
carries its model's *fingerprint* (compared: two pools exchange pages only when theirs are
equal) and its *name* (what it was loaded as, ``smollm2`` or a path: for messages only, since
one checkpoint loaded under two names is one model). Both travel in the Mooncake registration
(:mod:`kv.bootstrap`, :mod:`kv.wire`); the local backend compares the pools themselves
(:class:`kv.pool.KVGeometry`).
"""

from __future__ import annotations

#: Longest model fingerprint or name a pool carries (both travel in registrations).
MAX_MODEL_NAME = 200


def describe_model(name: str, fingerprint: str) -> str:
    """How an error names a model: ``'smollm2' (57b3...-float32)``, the fingerprint alone when
    the model has no name, ``an unnamed model`` when the pool was built without either."""
    if not fingerprint:
        return "an unnamed model"
    return f"{name!r} ({fingerprint})" if name else fingerprint
