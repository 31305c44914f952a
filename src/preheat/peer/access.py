"""Who may reach a peer server: the rule that a peer listening beyond loopback must require a token.

Torch-free and import-light on purpose: ``preheat serve`` checks it while validating its settings, before it binds
its socket and long before it imports the model code (``preheat.peer.server`` imports the checkpoint layer, which
imports torch).
"""

from __future__ import annotations

from preheat.core.errors import ConfigError
from preheat.http.control import is_loopback  # its home: every server's rule for control routes needs it too

__all__ = ["is_loopback", "require_token"]


def require_token(
    host: str,
    token: str | None,
    *,
    token_flag: str = "PREHEAT_PEER_TOKEN (or --peer-token)",  # noqa: S107 - the setting's name, not a token
    host_flag: str = "--peer-host",
) -> None:
    """``ConfigError`` when a peer server would bind ``host`` beyond loopback without a token; the message names
    the caller's flags (``preheat serve``'s by default)."""
    if token or is_loopback(host):
        return
    raise ConfigError(
        f"the peer server would serve every weight file to anyone who reaches {host or '*'}, with no token: set "
        f"{token_flag} to a shared secret on every replica, or bind the peer server to loopback "
        f"({host_flag} 127.0.0.1)"
    )
