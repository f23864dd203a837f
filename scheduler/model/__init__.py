"""Models behind the :class:`~scheduler.runner.ModelRunner` protocol: the fixed-point
reference model (exact, so disaggregated output equals the colocated run by construction) and
its byte tokenizer."""
