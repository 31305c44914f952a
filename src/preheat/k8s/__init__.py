"""Kubernetes, in one place: what preheat reads from the API (``client``: credentials, the official client imported
lazily; ``pod``/``pod_timeline``: a pod's start as timeline stages; ``slices``/``discovery``: replicas from a
Service's EndpointSlices) and what it deploys (``manifests/``, package data found by ``bundle``: the Kustomize base,
components and overlays, ``values.yaml`` and ``values.schema.json``; ``values``: defaults + files + profile, checked
against the schema; ``render``: valid values -> a Kustomize overlay of ``manifests/kustomize/base``).
The ``kubernetes`` package is the ``k8s`` extra, imported only when one of these runs."""
