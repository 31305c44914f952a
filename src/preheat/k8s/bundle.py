"""The deployment files shipped inside the package, so ``preheat deploy render`` works wherever preheat is installed
(no checkout needed): ``manifests/`` holds ``values.yaml`` (the defaults), ``values.schema.json`` and
``kustomize/`` (``base``, ``components``, one overlay per profile under ``overlays``). Found with
``importlib.resources``; the repository's ``deploy/image/Containerfile`` builds the image and is not shipped.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from preheat.core.errors import ConfigError

PACKAGE = "preheat.k8s"
FOLDER = "manifests"


def manifests_dir() -> Path:
    """The shipped ``manifests/`` folder, as a directory on disk (Kustomize reads bases and components from
    directories, by relative path). ``ConfigError`` when the package is not installed as files (a zip)."""
    root = files(PACKAGE).joinpath(FOLDER)
    if not isinstance(root, Path) or not root.is_dir():
        raise ConfigError(
            f"{PACKAGE}/{FOLDER}: the deployment files are not on disk in this installation ({root}); install preheat "
            "as files, or pass --deploy-dir with a copy of them"
        )
    return root
