"""Text in: a checkpoint's tokenizer and chat template, and OpenAI request bodies parsed into typed requests.

One package shared by the engine, the server and the router, so a prompt becomes the same token ids wherever it is
read (the router's chunk keys only match the replica's if they do). Torch-free, and cheap to import: ``tokenizers``
comes with ``preheat.text.tokenizer``, jinja2 with the first chat template rendered.

- ``request.py``: ``parse_request`` (a body → ``GenerationRequest``, or ``APIError`` naming the field) and the
  body bounds the server and the router share. The answers' wire format stays in ``preheat.server.openai``.
- ``tokenizer.py``: ``TextTokenizer`` (``tokenizer.json``, special tokens, end-of-sequence ids, streaming decode).
- ``chat.py``: ``ChatTemplate``, rendered as transformers renders it.
"""
