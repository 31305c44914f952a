"""Checkpoint formats, layouts and tensor-parallel plans, parsed from bytes it asks ``preheat.io`` and
``preheat.sources`` for. It opens files itself only to hash them (``digest``), to read JSON side files
(``jsonfile``), to write and publish checkpoints (``writer``, ``publish``) and, through transformers, GGUF."""
