"""An API client for the cluster this process runs in, or the one a kubeconfig names (the official ``kubernetes``
package, the ``k8s`` extra, imported here and only when a client is made).

Which credentials: ``KUBECONFIG`` when it is set (a test, or a router run from a laptop), else the pod's service
account when ``KUBERNETES_SERVICE_HOST`` is set (token and CA under /var/run/secrets/kubernetes.io/serviceaccount,
re-read as the kubelet rotates them), else ``~/.kube/config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from preheat.core import env as envs
from preheat.core.errors import ConfigError

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MISSING = "the Kubernetes client is not installed: pip install 'preheat[k8s]' (the official kubernetes package)"


def kubernetes_module() -> Any:  # Any: the kubernetes package (typed only in its recent releases)
    """The ``kubernetes`` package, or ``ConfigError`` saying which extra to install."""
    try:
        import kubernetes
    except ImportError:
        raise ConfigError(MISSING) from None
    return kubernetes


def api_client(
    env: Mapping[str, str] | None = None, *, service_account: str = SERVICE_ACCOUNT
) -> Any:  # Any: kubernetes.client.ApiClient (typed only in recent releases; imported lazily)
    """A ``kubernetes.client.ApiClient`` with this process's credentials (see the module's docstring); ``ConfigError``
    naming the kubeconfig or the service-account files when they cannot be read. ``service_account``: the directory
    the kubelet mounts the token and CA in."""
    # The in-cluster loader reads the service's host and port from this mapping, so it gets the whole environment.
    env = envs.snapshot() if env is None else env
    kubernetes = kubernetes_module()
    configuration = kubernetes.client.Configuration()
    kubeconfig = envs.get(envs.KUBECONFIG, env) or ""
    in_cluster = envs.get(envs.KUBERNETES_SERVICE_HOST, env) is not None
    try:
        if kubeconfig or not in_cluster:
            path = kubeconfig or os.path.expanduser("~/.kube/config")
            # persist_config=False: a refreshed token is kept in memory, never written back into the user's file.
            kubernetes.config.load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
            source = f"kubeconfig {path}"
        else:
            # The loader itself, not load_incluster_config(): that one reads os.environ, and the files' fixed paths.
            kubernetes.config.incluster_config.InClusterConfigLoader(
                token_filename=os.path.join(service_account, "token"),
                cert_filename=os.path.join(service_account, "ca.crt"),
                environ=env,
            ).load_and_set(configuration)
            source = "the pod's service account"
    except (kubernetes.config.ConfigException, OSError) as exc:
        where = (
            f"kubeconfig {kubeconfig or '~/.kube/config'}"
            if kubeconfig or not in_cluster
            else f"the pod's service account ({service_account})"
        )
        raise ConfigError(f"cannot read Kubernetes credentials from {where}: {exc}") from None
    client = kubernetes.client.ApiClient(configuration)
    client.preheat_source = source  # for log lines: which credentials this client uses
    return client


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of a ``kubernetes`` ApiException (None for other errors: refused, reset, timed out)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None
