"""Methods of the evaluation harness: how each one maps to a (HeadMap, LycheeConfig) of the same machinery.

    spec = method_spec("duo", model, budget=512, head_map=hm)    # -> MethodSpec(head_map, config, description)

Every sparse method runs through `lychee_compile` with the `lychee::hybrid_decode` op; none is a copy of another
project's code. Equal budget means equal tokens attended per non-retrieval head: a lychee sparse head attends
its `budget` selected tokens plus the sink and local blocks (ops/reference.py), so a streaming head at the same
budget gets a local window of budget + local_tokens (its LycheeConfig.budget is then sink + window: streaming heads
select nothing, so that field only has to pass validation).

| method       | retrieval heads                               | other heads                                  | first layer |
|--------------|-----------------------------------------------|----------------------------------------------|-------------|
| dense        | (uncompiled model)                            |                                              |             |
| lychee       | the given head map                            | sparse: sink + local + inherited blocks      | forced all retrieval |
| lychee-topp, lychee-threshold, lychee-ratio | as lychee; retrieval heads keep the policy's n <= K = ceil(budget / block_size) ranked blocks (LycheeConfig.selection; parameter from `policy_params`, defaults POLICY_DEFAULTS) | sparse: sink + local + the n inherited blocks | forced |
| tidal        | whole layers (default 0, 1, 2 and 13/32 of depth: TidalDecode's full layers 0-1, selection layer 2, re-selection layer) | sparse | forced |
| streamingllm | none                                          | streaming: sink + window of budget + local   | not forced (streaming too) |
| duo          | the given map's retrieval heads (full context) | streaming: sink + window of budget + local  | not forced  |
| random       | same count as the given map beyond layer 0, placed at random (seeded) | sparse                   | forced      |
| quest        | none: every head of every layer attends sink + local + its own top budget/block_size blocks by the Quest bound sum_i max(q_i kmin_i, q_i kmax_i) (LycheeConfig.quest="all"; GQA queries pooled) | | |

A retrieval head attends the whole context (and selects blocks for the sparse heads after it), so DuoAttention's
"retrieval heads keep full attention" is exactly a lychee retrieval head.

Selection policies (LycheeDecode §4.4.1, ops/policies.py): `lychee` is top-k (always K blocks). The policy methods
keep a data-dependent n <= K, so `budget` is their capacity, not what they attend; the harness measures what they do
attend (ops/sparsity.py, the "attended %" columns). Their parameter is part of the label (`lychee-topp=0.9@512`), so
two parameters of one policy are two variants: p of topp (attention mass incl. sink + local), tau of threshold (a
block's mass, i.e. its share of the group's mean probability), theta of ratio (fraction of the valid blocks).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..config import LycheeConfig
from ..head_map import HeadMap, model_geometry
from ..errors import MethodError

POLICY_METHODS = {"lychee-topp": "topp", "lychee-threshold": "threshold", "lychee-ratio": "ratio"}
# Defaults of --policy-param: p = 0.9 (LycheeDecode's top-p setting range), tau = 0.005 (a block holding 0.5% of the
# mass; ~1/200, so at 2K tokens = 128 blocks a uniform block (1/128) passes), theta = 0.25 (a quarter of the context).
POLICY_DEFAULTS = {"topp": 0.9, "threshold": 0.005, "ratio": 0.25}
METHODS = ("dense", "lychee", *POLICY_METHODS, "tidal", "streamingllm", "duo", "random", "quest")
UNAVAILABLE: dict[str, str] = {}
if "quest" not in {f.name for f in __import__("dataclasses").fields(LycheeConfig)}:   # older checkouts
    METHODS = METHODS[:-1]
    UNAVAILABLE["quest"] = "this LycheeConfig has no Quest bounds (LycheeConfig.quest)"
PLACEHOLDER_LAYERS = (0, 1, 15)                 # the demo's placeholder (cli.PLACEHOLDER_LAYERS)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str
    head_map: HeadMap | None        # None: dense (the uncompiled model)
    config: LycheeConfig | None
    description: str
    budget: int | None = None       # the nominal budget (tokens a non-retrieval head attends beyond sink + local)

    @property
    def variant(self) -> str:
        """The method with its selection parameter, if it has one: "lychee", "lychee-topp=0.9"."""
        if self.config is None or self.name not in POLICY_METHODS:
            return self.name
        return f"{self.name}={self.config.selection_param:g}"

    @property
    def label(self) -> str:
        return self.name if self.config is None else f"{self.variant}@{self.budget}"


def _spec(budget, name, head_map, config, description) -> MethodSpec:
    return MethodSpec(name, head_map, config, description, budget)


def parse_policy_params(text: str | None) -> dict[str, float]:
    """"topp=0.9,ratio=0.25" -> POLICY_DEFAULTS with those entries replaced (the --policy-param option)."""
    params = dict(POLICY_DEFAULTS)
    seen = set()
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep:
            raise MethodError(f"--policy-param: {part.strip()!r} is not POLICY=VALUE (e.g. topp=0.9,ratio=0.25)")
        if key not in POLICY_DEFAULTS:
            hint = " (topk keeps K = ceil(budget / block_size) blocks: set --budget)" if key == "topk" else ""
            raise MethodError(f"--policy-param: unknown policy {key!r}; choose from "
                              f"{', '.join(POLICY_DEFAULTS)}{hint}")
        if key in seen:
            raise MethodError(f"--policy-param: {key} given twice; give one value per policy")
        try:
            x = float(value)
        except ValueError:
            raise MethodError(f"--policy-param: {key}={value!r} is not a number") from None
        if not 0.0 < x <= 1.0:   # NaN fails this too
            raise MethodError(f"--policy-param: {key}={value} must be in (0, 1] (a probability mass, threshold or "
                              "fraction of the context)")
        seen.add(key)
        params[key] = x
    return params


def default_head_map(model) -> tuple[HeadMap, str]:
    """The certified map shipped in lychee_compile/data for this model's config if there is one (SmolLM2-135M,
    Qwen2.5-Coder-0.5B, Gemma-3-270M: training.shipped_map_for), else the demo's placeholder (whole layers 0, 1 and
    the middle one). Returns (map, where it came from)."""
    from ..training import certified_shipped_maps, shipped_map_for
    shipped = shipped_map_for(model)
    if shipped is not None:
        hm, path = shipped
        return hm, f"shipped map {os.path.basename(path)} ({hm!r})"
    n_layers = model.config.num_hidden_layers
    layers = sorted({l for l in PLACEHOLDER_LAYERS if l < n_layers} | {n_layers // 2})
    hm = HeadMap.for_model(model, layers=layers, method="placeholder-layers")
    # a shipped map of this shape made for another config (e.g. the same model loaded another way): say so
    near = [os.path.basename(p) for m, p in certified_shipped_maps() if m.shape == model_geometry(model.config)]
    hint = f"; {', '.join(near)} has this shape but another config fingerprint (--head-map to use it)" if near else ""
    return hm, f"PLACEHOLDER map (no map shipped for this model): whole layers {layers} retrieval{hint}"


def tidal_layers(n_layers: int) -> list[int]:
    """TidalDecode on Llama-3-8B (32 layers): full layers 0, 1; selection at layer 2; re-selection at layer 13."""
    return sorted({l for l in (0, 1, 2, round(13 * n_layers / 32)) if l < n_layers})


def random_map(model, count: int, seed: int = 0) -> HeadMap:
    """`count` retrieval heads placed uniformly at random in layers 1.. (layer 0 is all retrieval anyway)."""
    n_layers, n_kv = model_geometry(model.config)
    slots = (n_layers - 1) * n_kv
    if not 0 <= count <= slots:
        raise MethodError(f"random map: {count} retrieval heads do not fit in {slots} slots beyond layer 0")
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=g)[:count]
    retrieval = torch.zeros(n_layers, n_kv, dtype=torch.bool)
    retrieval[0] = True
    flat = retrieval[1:].reshape(-1).clone()
    flat[chosen] = True
    retrieval[1:] = flat.view(n_layers - 1, n_kv)
    return HeadMap(retrieval, {"method": "random", "seed": str(seed), "count": str(count)}).with_model_metadata(model)


def retrieval_count_beyond_first(head_map: HeadMap) -> int:
    return int(head_map.retrieval[1:].sum())


def method_spec(name: str, model, budget: int, head_map: HeadMap | None = None, *, block_size: int = 16,
                sink_tokens: int = 16, local_tokens: int = 64, backend: str = "eager", seed: int = 0,
                layers: list[int] | None = None, policy_params: dict[str, float] | None = None) -> MethodSpec:
    """The (HeadMap, LycheeConfig) of method `name` at `budget` tokens. `head_map`: the map lychee, duo and random
    start from (default: default_head_map(model)); `layers`: tidal's whole retrieval layers; `policy_params`: the
    policy methods' parameters (parse_policy_params; default POLICY_DEFAULTS)."""
    if name in UNAVAILABLE:
        raise MethodError(f"method {name!r} is not available: {UNAVAILABLE[name]}")
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; available: {', '.join(METHODS)} "
                          f"(not available: {', '.join(UNAVAILABLE)})")
    if name == "dense":
        return MethodSpec("dense", None, None, "dense attention, uncompiled model", None)
    if head_map is None and name in ("lychee", "duo", "random", *POLICY_METHODS):
        head_map, _ = default_head_map(model)
    # No CUDA graphs here: the reference numerics (eager backend, or fp32 Inductor calling the op's reference as an
    # extern kernel) has nothing to capture. The kernels numerics turns the default (on) back (eval/numerics.py); the
    # cache copies the harness decodes keep their addresses for it (eval/scratch_cache.py).
    base = dict(budget=budget, block_size=block_size, sink_tokens=sink_tokens, backend=backend, cuda_graphs=False)
    n_layers, n_kv = model_geometry(model.config)
    if name == "lychee":
        cfg = LycheeConfig(local_tokens=local_tokens, **base)
        return _spec(budget, name, head_map, cfg, f"given map ({int(head_map.retrieval.sum())} retrieval heads, "
                                               f"method={head_map.metadata.get('method', '?')}), sparse others")
    if name in POLICY_METHODS:
        policy = POLICY_METHODS[name]
        params = POLICY_DEFAULTS if policy_params is None else policy_params
        if policy not in params:
            raise MethodError(f"{name}: no parameter for policy {policy!r} in {params} (use parse_policy_params)")
        cfg = LycheeConfig(local_tokens=local_tokens, selection=policy, selection_param=float(params[policy]),
                           **base)
        return _spec(budget, name, head_map, cfg,
                     f"given map ({int(head_map.retrieval.sum())} retrieval heads), retrieval heads keep "
                     f"{policy}({cfg.selection_param:g}) blocks, at most K = {cfg.num_select}; sparse others")
    if name == "tidal":
        layers = tidal_layers(n_layers) if layers is None else sorted(layers)
        hm = HeadMap.for_model(model, layers=layers, method="tidal-layers")
        return _spec(budget, name, hm, LycheeConfig(local_tokens=local_tokens, **base),
                          f"whole layers {layers} retrieval, every other layer reuses their selection")
    if name == "random":
        count = retrieval_count_beyond_first(head_map)
        hm = random_map(model, count, seed)
        return _spec(budget, name, hm, LycheeConfig(local_tokens=local_tokens, **base),
                          f"{count} random retrieval heads beyond layer 0 (seed {seed}), sparse others")
    if name == "quest":
        # The op's quest="all" makes every head a Quest head (the map's retrieval marks are overridden); the
        # bounds are recomputed from the cache each step (exact min/max; no incremental descriptor buffer yet).
        hm = HeadMap.for_model(model, layers=[0], method="quest")
        cfg = LycheeConfig(local_tokens=local_tokens, quest="all", **base)
        return _spec(budget, name, hm, cfg, f"every head Quest: sink + local + own top {cfg.num_select} blocks "
                                            "by the min/max key bound")
    # Streaming heads attend sink + a local window; at equal budget the window is budget + local_tokens (what a
    # lychee sparse head attends besides its sink blocks). Streaming heads select nothing, so the config's budget
    # is only set high enough to pass validation (sink + local <= budget); retrieval heads (duo) attend everything.
    window = budget + local_tokens
    base["budget"] = sink_tokens + window
    cfg = LycheeConfig(local_tokens=window, first_layer_retrieval=False, **base)
    if name == "streamingllm":
        hm = HeadMap(torch.zeros(n_layers, n_kv, dtype=torch.bool), {"method": "streamingllm"},
                     streaming=torch.ones(n_layers, n_kv, dtype=torch.bool)).with_model_metadata(model)
        return _spec(budget, name, hm, cfg, f"every head streaming: {sink_tokens} sink + {window} local tokens")
    # duo
    retrieval = head_map.retrieval.clone()
    hm = HeadMap(retrieval, {"method": "duo", "from": head_map.metadata.get("method", "?")},
                 streaming=~retrieval).with_model_metadata(model)
    return _spec(budget, name, hm, cfg, f"{int(retrieval.sum())} retrieval heads full, others streaming "
                                     f"({sink_tokens} sink + {window} local)")
