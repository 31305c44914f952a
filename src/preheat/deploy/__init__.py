"""Kubernetes deployment (docs/kubernetes.md): values in, a Kustomize overlay of ``deploy/kustomize/base`` out.

``values`` merges the defaults, the user's files and a profile, and checks the result against
``deploy/values.schema.json``, so a bad value fails at render time with the key named. ``render`` turns valid
values into a ``kustomization.yaml`` (components, images, patches). Both are pure; ``preheat deploy render`` (the
CLI) reads the files and runs ``kubectl kustomize``.
"""
