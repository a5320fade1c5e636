"""Model parameters in the cache: saved, registered from safetensors files, loaded, and streamed in ahead of use.

- `save_model(model, cache, name)` stores each module's parameters and
  buffers as a value, then a manifest (`cacheclient.models.saving`);
- `register_safetensors(cache, name, key)` makes a safetensors file in object
  storage a saved model without rewriting it (`cacheclient.models.safetensors`);
- `load_model(model, cache, name)` fills a model built on `meta` from them;
- `with stream_parameters(model, cache, name, budget_bytes=...):` runs a model
  whose parameters stream from the cache in its execution order
  (`cacheclient.models.streaming`);
- `read_manifest(cache, name)` is the saved model's `ModelManifest`
  (`cacheclient.models.manifest`), committed through `cacheclient.manifests`.

Users import these names from `cacheclient.prefetch`. This package needs
torch; `cacheclient` itself does not import it.
"""

from __future__ import annotations

from cacheclient.models.manifest import (
    DEFAULT_PART_BYTES,
    RANGES,
    RECORD,
    ModelManifest,
    ModuleEntry,
    ParameterValueError,
    TensorInfo,
    Tie,
    manifest_key,
    model_record,
    read_manifest,
)
from cacheclient.models.safetensors import SAFETENSORS_DTYPES, register_safetensors
from cacheclient.models.saving import load_model, save_model
from cacheclient.models.streaming import ParameterStream, stream_parameters

__all__ = [
    "DEFAULT_PART_BYTES",
    "RANGES",
    "RECORD",
    "SAFETENSORS_DTYPES",
    "ModelManifest",
    "ModuleEntry",
    "ParameterStream",
    "ParameterValueError",
    "TensorInfo",
    "Tie",
    "load_model",
    "manifest_key",
    "model_record",
    "read_manifest",
    "register_safetensors",
    "save_model",
    "stream_parameters",
]
