"""Compiled artifacts (docs/peer.md): ``blobs`` (the blob format, keys and trust rules, pure), ``signing`` (Ed25519
keys), ``store`` (the node cache's ``compiled/`` directory and fetches from peers) and ``vllm`` (vLLM's compile cache
as artifacts, read from its distribution, never imported)."""
