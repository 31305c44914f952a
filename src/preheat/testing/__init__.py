"""Doubles shipped for tests and benchmarks, never used by a serving path: a Range-capable file server with fault
injection (``fileserver``), random-weight Llama-shaped checkpoints (``synthetic``), SmolLM2 converted once per dtype
(``smollm2``), real ``redis-server`` and ``vllm serve`` children (``redisserver``, ``vllmserver``), and what they
share (``certs``, ``ports``, ``needs``). Importable without pytest, vLLM or a GPU."""
