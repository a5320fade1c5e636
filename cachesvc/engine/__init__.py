"""The tier engine and the objects it uses to keep tiers consistent."""

from cachesvc.engine.engine import MAX_KEY_BYTES, Engine
from cachesvc.engine.namespaces import Hit, Namespace, WriteMode

__all__ = ["MAX_KEY_BYTES", "Engine", "Hit", "Namespace", "WriteMode"]
