"""Plans the cache prefetches ahead of, and model parameters that live in the cache and stream in ahead of use.

The public entry users import; the code lives in `cacheclient.plans` (what
a job will read, in order, handed to the server to prefetch ahead of) and
`cacheclient.models` (saving, registering, loading and streaming a model's
parameters).

Plans: a `Plan` is what a job will read, in order: a list of steps, each
naming the keys it needs (a batch of samples, a module's parameters).
`Plan.sampler_order`, `Plan.execution_order` and `Plan(steps)` build one;
`plan.start(cache, window_bytes=...)` hands it to the cache server, which
fetches ahead of the reads it serves (from S3 into its memory) while at most
`window_bytes` are fetched and not yet read. The server learns progress from
those reads; `PlanRun.advance` reports it explicitly.

Parameters: `save_model(model, cache, name)` stores each module's own
parameters and buffers as one value (a tensor record,
`cacheclient.wire.tensors`: raw bytes behind a small header, a checksum per
tensor, no pickle), split in parts past `part_bytes`, and then a manifest
value that lists the modules, their keys, tensor names, dtypes and shapes.
Every value is bound to its save and module path, so a value from another
save or under another key is refused. `load_model` fills a model built on
the `meta` device from them; `register_safetensors` makes a safetensors file
in object storage a saved model without rewriting it.

Streaming: inside `with stream_parameters(model, cache, name,
budget_bytes=...)` the model (or its `generate`) runs as usual while its
parameters live in the cache, each module's fetched ahead of its use in the
recorded execution order, at most `budget_bytes` held. Results are
bit-identical to the model with every parameter local. A value that is
missing or corrupt raises `ParameterValueError`, naming the module, when
that module runs.

This module needs torch; `cacheclient` itself does not import it.
"""

from __future__ import annotations

from cacheclient.models import (
    DEFAULT_PART_BYTES,
    RANGES,
    RECORD,
    ModelManifest,
    ModuleEntry,
    ParameterStream,
    ParameterValueError,
    TensorInfo,
    Tie,
    load_model,
    manifest_key,
    model_record,
    read_manifest,
    register_safetensors,
    save_model,
    stream_parameters,
)
from cacheclient.plans import Plan, PlanRun

__all__ = [
    "DEFAULT_PART_BYTES",
    "RANGES",
    "RECORD",
    "ModelManifest",
    "ModuleEntry",
    "ParameterStream",
    "ParameterValueError",
    "Plan",
    "PlanRun",
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
