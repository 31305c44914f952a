"""preheat's blob store inside LMCache: the module LMCache's configuration names (``connector`` has the code).

    remote_storage_plugins: ["preheat"]
    extra_config:
      remote_storage_plugin.preheat.module_path: preheat.integrations.lmcache
      remote_storage_plugin.preheat.class_name: PreheatConnector
      remote_storage_plugin.preheat.url: fs:///shared/kv

LMCache's plugin loader imports this package and looks up ``PreheatConnector``, which is built (on LMCache's
``RemoteConnector``) at that first lookup: importing the package imports no LMCache. ``warm`` fills LMCache's local
CPU backend from the store before a replica takes traffic (docs/kv-store.md).
"""

from preheat.integrations.lmcache.connector import (
    ENGINE,
    PLUGIN,
    SUPPORTED,
    __getattr__,  # noqa: F401 - PreheatConnector, the class LMCache's plugin loader looks up here
    connector_class,
    namespace_for,
    open_for,
    settings_from,
    warm,
)

__all__ = ["ENGINE", "PLUGIN", "SUPPORTED", "connector_class", "namespace_for", "open_for", "settings_from", "warm"]
