"""Checkpoint formats, layouts and tensor-parallel plans. Asks ``preheat.io`` for bytes; never reads on its own."""
