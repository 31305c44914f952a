"""``preheat.load``: a checkpoint from any source into tensors (``load``: plan, execute, report)."""
