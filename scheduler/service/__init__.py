"""The SGLang-compatible HTTP service behind ``pdlife serve``: configuration, the engine loop,
the request registry, the FastAPI app, its schema, middleware and metrics."""
