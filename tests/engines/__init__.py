"""Tests against the real engines; helpers in engines.enginekit (a package, so mypy does not see two conftests)."""
