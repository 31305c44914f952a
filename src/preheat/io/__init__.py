"""Bytes, files, buffers and devices. Nothing in here knows what a model or a tensor name is."""
