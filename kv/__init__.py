"""pdlife."""
