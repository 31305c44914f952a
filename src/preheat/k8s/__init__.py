"""What preheat reads from the Kubernetes API: the shared client set-up (``client``) and, pure, a pod's start as
timeline stages (``pod``). The ``kubernetes`` package is the ``k8s`` extra, imported only when one of these runs."""
