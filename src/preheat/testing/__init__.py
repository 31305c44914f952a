"""Doubles shipped for tests and benchmarks, never used by a serving path: a Range-capable file server with fault
injection (``fileserver``) and random-weight Llama-shaped checkpoints (``synthetic``)."""
