"""pdlife's scheduler and what stands around it, in rooms that import only downward.

``messages`` and ``runner`` are the contracts every room shares; ``model`` and ``dist`` sit on
them; ``prefill`` and ``decode`` drive requests; ``assemble`` and ``embedded`` wire them with the
KV layer; ``service``, ``demo``, ``testing`` and ``cli`` use all of these
(``docs/architecture.md`` draws the order).
"""
