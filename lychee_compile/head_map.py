"""HeadMap: which KV heads of which layers are retrieval heads. bool [num_layers, num_kv_heads], stored as safetensors.

A head is one of three kinds: retrieval (attends everything, selects blocks), sparse (attends the previous global
layer's selection for its KV head + sink + local; the default), or streaming (sink + local only, inherits nothing and
passes on nothing -- StreamingLLM / DuoAttention baselines). `streaming` is an optional second bool map.

Rows exist for every layer. Rows of sliding-window layers are ignored (those layers keep their own attention), and
the first global layer is always all retrieval (nothing precedes it to inherit from); both facts are warned about,
never hidden, when a map says otherwise.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings

import torch

from .errors import HeadMapError, HeadMapWarning


# Config fields that identify a model's attention geometry and weights family. A map made for another model with
# the same shape differs here (e.g. vocab or rope theta), which is how the fingerprint catches it.
_FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rope_theta",
                       "rope_parameters", "max_position_embeddings", "sliding_window", "layer_types")


def config_fingerprint(config) -> str:
    return _fingerprint(config, _canonical)


def legacy_config_fingerprint(config) -> str:
    """The fingerprint as it was made before nested values were canonicalized, which maps and calibration folders
    made then carry; it differs from config_fingerprint only where a nested dict's keys were out of order (e.g. a
    config built from a GGUF, or an old hub config whose rope_scaling transformers rewrites) or a value held tuples."""
    return _fingerprint(config, lambda value: value)


def config_fingerprints(config) -> tuple[str, str]:
    """(config_fingerprint, legacy_config_fingerprint): a recorded fingerprint is this config's if it is either."""
    return config_fingerprint(config), legacy_config_fingerprint(config)


def fingerprint_matches(fingerprint: str | None, config) -> bool:
    """Whether a recorded fingerprint is this config's, as made now or before (legacy_config_fingerprint)."""
    return fingerprint in config_fingerprints(config)


def _fingerprint(config, canonical) -> str:
    items = {}
    for name in _FINGERPRINT_FIELDS:
        value = getattr(config, name, None)
        items[name] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(canonical(value))
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def _canonical(value):
    """`value` as its saved JSON reads back: dict keys as sorted strings, tuples as lists. A config read back from its
    config.json (which sorts keys) and the same config built in memory (e.g. from a GGUF, in another key order) must
    fingerprint alike."""
    if isinstance(value, dict):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def model_geometry(config) -> tuple[int, int]:
    """(num_layers, num_kv_heads) of a transformers config."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if layers is None or heads is None:
        raise HeadMapError(f"The model config ({type(config).__name__}) has no num_hidden_layers / "
                           "num_attention_heads: lychee_compile supports decoder-only transformers models.")
    return int(layers), int(kv)


class HeadMap:
    """retrieval: bool [num_layers, num_kv_heads]; metadata: str -> str (architecture, fingerprint, method, ...)."""

    def __init__(self, retrieval: torch.Tensor, metadata: dict[str, str] | None = None,
                 streaming: torch.Tensor | None = None):
        self.retrieval = self._as_bool_map(retrieval, "retrieval")
        self.streaming = (torch.zeros_like(self.retrieval) if streaming is None
                          else self._as_bool_map(streaming, "streaming"))
        if self.streaming.shape != self.retrieval.shape:
            raise HeadMapError(f"HeadMap.streaming has shape {tuple(self.streaming.shape)} but retrieval has "
                               f"{tuple(self.retrieval.shape)}.")
        if (self.streaming & self.retrieval).any():
            raise HeadMapError("a head cannot be both retrieval and streaming; clear one of the two maps there.")
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}

    @staticmethod
    def _as_bool_map(retrieval, name: str) -> torch.Tensor:
        if not isinstance(retrieval, torch.Tensor):
            raise HeadMapError(f"HeadMap({name}=...) takes a bool tensor [num_layers, num_kv_heads], "
                               f"got {type(retrieval).__name__}.")
        if retrieval.dtype != torch.bool:
            if retrieval.is_floating_point() and torch.isnan(retrieval).any():
                raise HeadMapError(f"HeadMap.{name} contains NaN; it must be bool (True = {name} head).")
            if not ((retrieval == 0) | (retrieval == 1)).all():
                raise HeadMapError(f"HeadMap.{name} must be bool (or 0/1 values); got values other than 0 and 1.")
            retrieval = retrieval.to(torch.bool)
        if retrieval.dim() != 2:
            raise HeadMapError(f"HeadMap.{name} must be 2-D [num_layers, num_kv_heads], got shape "
                               f"{tuple(retrieval.shape)}.")
        return retrieval.detach().cpu().contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.retrieval.shape)

    @property
    def recommended_budget(self) -> int | None:
        """The budget (tokens) `lychee calibrate` recommends for this map, from its metadata; None if uncalibrated.
        Whether it was certified: `calibration["status"]`."""
        value = self.metadata.get("recommended_budget")
        return None if value is None else int(value)

    @property
    def calibration(self) -> dict | None:
        """The calibration record (lychee_compile/calibrate/record.py) `lychee calibrate` wrote, or None."""
        value = self.metadata.get("calibration")
        return None if value is None else json.loads(value)

    def digest(self) -> str:
        h = hashlib.sha256((self.retrieval.to(torch.uint8) + 2 * self.streaming.to(torch.uint8)).numpy().tobytes())
        h.update(json.dumps(list(self.shape)).encode())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        n = int(self.retrieval.sum())
        return (f"HeadMap({self.shape[0]} layers x {self.shape[1]} KV heads, {n} retrieval, "
                f"{int(self.streaming.sum())} streaming, "
                f"method={self.metadata.get('method', '?')})")

    # --- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model, layers: list[int] | None = None, method: str = "layers", **metadata) -> "HeadMap":
        """Whole layers as retrieval (TidalDecode-style layer-level map); `layers=None` means every layer."""
        n_layers, n_kv = model_geometry(model.config)
        retrieval = torch.zeros(n_layers, n_kv, dtype=torch.bool)
        retrieval[list(range(n_layers)) if layers is None else layers] = True
        return cls(retrieval, {"method": method, **metadata}).with_model_metadata(model)

    def with_model_metadata(self, model) -> "HeadMap":
        meta = dict(self.metadata)
        meta.update(architecture=type(model).__name__, num_layers=str(self.shape[0]),
                    num_kv_heads=str(self.shape[1]), config_fingerprint=config_fingerprint(model.config))
        return HeadMap(self.retrieval, meta, self.streaming)

    # --- persistence --------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file
        tensors = {"retrieval": self.retrieval.to(torch.uint8)}
        if self.streaming.any():
            tensors["streaming"] = self.streaming.to(torch.uint8)
        save_file(tensors, os.fspath(path), metadata=self.metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HeadMap":
        from safetensors import safe_open
        path = os.fspath(path)
        if not os.path.exists(path):
            raise HeadMapError(f"Head map file {path!r} does not exist.")
        try:
            with safe_open(path, framework="pt") as f:
                metadata = f.metadata() or {}
                if "retrieval" not in f.keys():
                    raise HeadMapError(f"{path!r} is a safetensors file but has no 'retrieval' tensor; "
                                       "write head maps with HeadMap.save().")
                retrieval = f.get_tensor("retrieval")
                streaming = f.get_tensor("streaming") if "streaming" in f.keys() else None
        except HeadMapError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated / foreign files
            raise HeadMapError(f"{path!r} is not a readable safetensors head map ({exc}). "
                               "Recreate it with HeadMap.save().") from exc
        return cls(retrieval, metadata, streaming)

    # --- validation against a model -----------------------------------------------------------------------------
    def validate_for(self, model, strict: bool) -> None:
        """Raise HeadMapError if this map cannot describe `model`; warn (error if strict) on a fingerprint mismatch."""
        n_layers, n_kv = model_geometry(model.config)
        if self.shape != (n_layers, n_kv):
            raise HeadMapError(
                f"Head map shape {self.shape} does not match the model: {type(model).__name__} has {n_layers} "
                f"layers x {n_kv} KV heads. Make a map for this model, e.g. "
                f"HeadMap(torch.zeros({n_layers}, {n_kv}, dtype=torch.bool)) or HeadMap.for_model(model, layers=[...]).")
        want = self.metadata.get("config_fingerprint")
        have, legacy = config_fingerprints(model.config)
        if want is not None and want not in (have, legacy):
            msg = (f"Head map was made for another model (config fingerprint {want}, architecture "
                   f"{self.metadata.get('architecture', '?')}); this model's fingerprint is {have} "
                   f"({type(model).__name__}). Its heads are probably not this model's retrieval heads: "
                   "learn or load a map for this model.")
            if strict:
                raise HeadMapError(msg + " (LycheeConfig(strict=False) downgrades this to a warning.)")
            warnings.warn(msg, HeadMapWarning, stacklevel=3)

    def effective(self, global_layers: list[int], first_layer_retrieval: bool = True) -> torch.Tensor:
        """The map the ops use: rows of non-global layers are irrelevant; the first global layer is all retrieval
        unless `first_layer_retrieval=False` (baselines such as StreamingLLM).

        Warns when the stored map says otherwise, so nobody believes a row that has no effect.
        """
        eff = self.retrieval.clone()
        if not first_layer_retrieval:
            return eff
        ignored = [l for l in range(self.shape[0]) if l not in global_layers and bool(eff[l].any())]
        if ignored:
            warnings.warn(f"Head map rows of sliding-window layers {ignored} mark retrieval heads; sliding layers "
                          "keep their own attention, so those rows are ignored.", HeadMapWarning, stacklevel=3)
        if global_layers:
            first = global_layers[0]
            if not bool(eff[first].all()):
                warnings.warn(f"The first global layer ({first}) is always all retrieval (there is no earlier "
                              "selection to inherit); the map's sparse heads there are treated as retrieval.",
                              HeadMapWarning, stacklevel=3)
            eff[first] = True
        return eff
