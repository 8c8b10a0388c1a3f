"""One calibration run's working state: the base model, the prompt sets and their dense prefills, one compiled
variant per budget (the head count changes through set_head_map: the kinds are runtime data, nothing recompiles),
and the resume store every finished piece goes to.
"""
from __future__ import annotations

import json
import time

import torch

from ..config import LycheeConfig
from ..head_map import HeadMap
from .evaluate import PromptBank, compare, counters_of
from .head_scores import score_heads, top_heads
from .kv_bytes import mean_bytes
from .prompts import prompt_set


class Session:
    def __init__(self, model, tokenizer, target, store, kw: dict, progress: bool, log):
        self.model, self.tokenizer, self.target, self.store, self.kw, self.log = model, tokenizer, target, store, kw, log
        self.progress = progress
        self._items, self._banks, self._variants = {}, {}, {}
        self._dense = None          # the dense Variant certification scores, built once for every attempt
        self._global_layers = store.get("global_layers")
        self.points_evaluated = 0
        self._bar = None
        from ..eval.numerics import NUMERICS
        self.numerics = NUMERICS[kw["numerics"]] if "numerics" in kw else None    # None: the model as given

    # --- inputs --------------------------------------------------------------------------------------------------
    def search_items(self, task: str) -> list:
        if task not in self._items:
            k = self.kw
            self._items[task] = prompt_set(self.tokenizer, task, k["lengths"], k["search_prompts"], k["search_seed"],
                                           k["text"], k["score_tokens"], k["chat_template"])
        return self._items[task]

    def head_scores(self, given=None) -> torch.Tensor:
        if given is not None:
            return torch.as_tensor(given, dtype=torch.float32)
        saved = self.store.get("head_scores")
        if saved is None:
            k = self.kw
            t0 = time.perf_counter()
            if k["scorer"] == "sensitivity":
                scores = self.sensitivity_scores()
            else:
                scores = score_heads(self.model, self.tokenizer, k["scorer"], min(k["lengths"]), k["score_samples"],
                                     progress=self.progress, hardkuma_steps=k["hardkuma_steps"],
                                     checkpoint=self.store.path + ".hardkuma")
            saved = dict(scores=scores.tolist(), wall_s=round(time.perf_counter() - t0, 1))
            self.store.put("head_scores", saved)
        return torch.tensor(saved["scores"])

    def sensitivity_scores(self) -> torch.Tensor:
        """float [L, Hkv]: for each KV head of the global layers after the first, what the search prompts lose when
        that head alone is sparse (every other global head retrieval) at the smallest searched budget: the mean
        increase in NLL per prompt over dense, summed over the target's tasks. top_heads keeps the heads that lose
        the most as retrieval heads. The first global layer's heads and sliding layers' rows score 0 (never chosen).
        One scoring of the search prompts per candidate head and task, each stored as it finishes
        (`sensitivity/b{budget}/{task}/{layer}-{head}`: resume, and the per-task split in state.json). The heads are
        ranked on the prompts that then judge the search's points: only certification's held-out prompts are free
        of that selection."""
        from ..head_map import model_geometry
        layers = self.global_layers()
        retrieval = torch.zeros(model_geometry(self.model.config), dtype=torch.bool)     # [L, Hkv]
        retrieval[layers] = True
        scores = torch.zeros(retrieval.shape)
        budget = self.kw["budgets"][0]
        candidates = [(layer, head) for layer in layers[1:] for head in range(retrieval.shape[1])]
        if not candidates:
            self.log("sensitivity: no candidate heads (one global layer, whose heads are retrieval anyway)")
            return scores
        for layer, head in candidates:
            alone = retrieval.clone()
            alone[layer, head] = False
            for task in self.target.tasks:
                scores[layer, head] += self._sensitivity(alone, budget, task, f"{layer}-{head}")
        self.log(f"sensitivity (mean NLL increase per prompt when the head alone is sparse, budget {budget}, summed "
                 "over " + ", ".join(self.target.tasks) + "): "
                 + ", ".join(f"layer {lay} head {h}: {scores[lay, h]:+.4f}" for lay, h in candidates))
        return scores

    def _sensitivity(self, retrieval: torch.Tensor, budget: int, task: str, name: str) -> float:
        key = f"sensitivity/b{budget}/{task}/{name}"
        if self.store.get(key) is None:
            from ..api import set_head_map
            v = self.variant(budget)
            set_head_map(v.model, HeadMap(retrieval, {"method": "sensitivity probe"}).with_model_metadata(self.model))
            recs, dense = self._scored(v, task, f"sensitivity of {name}")
            self.store.put(key, sum(r["nll"] - d["nll"] for r, d in zip(recs, dense)) / len(recs))
        return self.store.get(key)

    def lychee_config(self, budget: int) -> LycheeConfig:
        k = self.kw
        return LycheeConfig(budget=budget, block_size=k["block_size"], sink_tokens=k["sink_tokens"],
                            local_tokens=k["local_tokens"], backend=k["backend"])

    # --- variants ------------------------------------------------------------------------------------------------
    def variant(self, budget: int, backend: str | None = None, head_map: HeadMap | None = None):
        """The compiled weight-sharing copy for `budget` (eval/scoring.Variant through eval/methods.method_spec)."""
        from ..eval.methods import method_spec
        from ..eval.scoring import Variant
        backend = backend or self.kw["backend"]
        key = (budget, backend)
        if key not in self._variants or head_map is not None:
            hm = head_map or HeadMap.for_model(self.model, layers=[0], method="calibration probe")
            k = self.kw
            spec = method_spec("lychee", self.model, budget, hm, block_size=k["block_size"],
                               sink_tokens=k["sink_tokens"], local_tokens=k["local_tokens"], backend=backend)
            v = Variant.build(self.model, spec, self.numerics)
            if head_map is not None:
                return v
            self._variants[key] = v
        return self._variants[key]

    def global_layers(self) -> list[int]:
        if self._global_layers is None:
            from ..api import state_of
            self._global_layers = list(state_of(self.variant(self.kw["budgets"][0]).model).global_layers)
            self.store.put("global_layers", self._global_layers)
        return self._global_layers

    def head_map(self, scores: torch.Tensor, heads: int) -> HeadMap:
        retrieval = top_heads(scores, heads, self.global_layers())
        meta = {"method": f"calibrated ({self.kw['scorer']})", "retrieval_heads": str(heads),
                "scores": json.dumps([[round(float(x), 4) for x in row] for row in scores])}
        return HeadMap(retrieval, meta).with_model_metadata(self.model)

    def kv_bytes(self, retrieval, budget: int | None) -> float:
        cfg = None if budget is None else self.lychee_config(budget)
        return mean_bytes(self.model.config, retrieval, self.global_layers(), cfg, self.kw["lengths"],
                          self.model.dtype.itemsize)

    # --- scoring -------------------------------------------------------------------------------------------------
    def bar(self):
        if self._bar is None:
            from tqdm.auto import tqdm
            self._bar = tqdm(desc="calibrate", unit="score", disable=not self.progress, dynamic_ncols=True)
        return self._bar

    def bank(self, task: str) -> PromptBank:
        if task not in self._banks:
            self._banks[task] = PromptBank(self.model, self.search_items(task))
        return self._banks[task]

    @property
    def scorings(self) -> int:
        return sum(b.scored for b in self._banks.values())

    def dense_records(self, task: str) -> list[dict]:
        key = f"dense/search/{task}"
        if self.store.get(key) is None:
            from ..eval.methods import method_spec
            from ..eval.scoring import Variant
            dense = Variant.build(self.model, method_spec("dense", self.model, 1), self.numerics)
            self.bar().set_postfix_str(f"dense {task}")
            self.store.put(key, self.bank(task).score(dense, "dense", self.bar().update))
        return self.store.get(key)

    def evaluate_point(self, scores, heads: int, budget: int) -> dict:
        key = f"point/h{heads}-b{budget}"
        if self.store.get(key) is not None:
            return self.judged(self.store.get(key))
        from ..api import set_head_map
        hm = self.head_map(scores, heads)
        dense_bytes = self.kv_bytes(None, None)
        rec = dict(heads=heads, budget=budget, retrieval_heads_total=int(hm.retrieval.sum()),
                   bytes=self.kv_bytes(hm.retrieval, budget), quality={}, counters={})
        rec["bytes_ratio"] = rec["bytes"] / dense_bytes
        v = self.variant(budget)
        set_head_map(v.model, hm)
        for task in self.target.tasks:
            before = v.counters().decode_calls
            recs, dense = self._scored(v, task, f"{heads} heads, budget {budget}", kl=self.target.needs_kl(task))
            row = compare(recs, dense, "lychee")
            rec["counters"][task] = counters_of(v, before)
            for metric in self.target.of_task(task):
                rec["quality"][metric.name] = dict(value=metric.value(row), interval=metric.interval(row), n=row["n"])
        self.points_evaluated += 1
        rec = json.loads(json.dumps(rec))        # as the store gives it back on resume (tuples -> lists)
        self.store.put(key, rec)
        rec = self.judged(rec)
        self.log(f"  {heads:3d} heads, budget {budget:5d}: {100 * rec['bytes_ratio']:5.1f}% of dense bytes, "
                 + ", ".join(f"{m} {q['value']:+.3g}" for m, q in rec["quality"].items())
                 + (" -> passes the search" if rec["passes"] else " -> misses"))
        return rec

    def _scored(self, variant, task: str, what: str, kl: bool = False) -> tuple[list[dict], list[dict]]:
        """The search prompts of `task` scored through `variant` as its map stands, and the dense records."""
        dense = self.dense_records(task)
        self.bar().set_postfix_str(f"{what}: {task}")
        return self.bank(task).score(variant, "lychee", self.bar().update, kl=kl), dense

    def judged(self, rec: dict) -> dict:
        """The point with `passes` by the search rule: every point estimate within the bound less the margin
        (judged anew on resume, so a rerun with another --search-margin reuses the scored points)."""
        m = self.kw["search_margin"]
        return dict(rec, passes=all(metric.within(rec["quality"][metric.name]["value"], m)
                                    for metric in self.target.metrics))

    def certify(self, scores, best: dict, held_out: dict, min_prompts: int, batch_size: int,
                certify_backend: str | None, certify_seed: int) -> dict:
        from ..eval.methods import method_spec
        from ..eval.scoring import Variant
        from .certify import certify
        backend = certify_backend or ("inductor" if self.model.device.type == "cuda" else self.kw["backend"])
        hm = self.head_map(scores, best["heads"])
        built = []

        def variants():
            """(dense, lychee), built on first use: a resumed, finished certification compiles nothing."""
            if not built:
                from ..api import set_head_map
                if backend == self.kw["backend"]:            # the search's compiled copy, switched to this map
                    lychee = self.variant(best["budget"])
                    set_head_map(lychee.model, hm)
                else:
                    lychee = self.variant(best["budget"], backend, head_map=hm)
                if self._dense is None:
                    self._dense = Variant.build(self.model, method_spec("dense", self.model, 1), self.numerics)
                built.append((self._dense, lychee))
            return built[0]
        held = dict(seed=certify_seed, n={t: len(i) for t, i in held_out.items()}, batch=batch_size,
                    device=self.model.device.type)
        key = "certify/" + json.dumps(dict(held, heads=best["heads"], budget=best["budget"], backend=backend),
                                      sort_keys=True)
        pad = self.tokenizer.pad_token_id if getattr(self.tokenizer, "pad_token_id", None) is not None else 0
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(len(i) for i in held_out.values()), desc="certify", unit="prompt",
                   disable=not self.progress, dynamic_ncols=True)
        out = certify(self.model, variants, held_out, self.target, min_prompts, batch_size, self.store, key,
                      "certify-dense/" + json.dumps(held, sort_keys=True), pad, bar.update)
        bar.close()
        out.update(backend=backend, batch_size=batch_size, device=str(self.model.device), seed=certify_seed,
                   attempt=key, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return out
