"""preheat inside the engines people run: vLLM's ``--load-format preheat`` and compiled caches (docs/integrations.md).

Each engine's module imports that engine lazily: ``import preheat.integrations`` never pulls in vLLM or SGLang.
"""
