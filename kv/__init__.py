"""pdlife's KV layer: the paged pool, metadata buffers, the transfer contract and its backends."""
