"""Teacher-forced scoring through the compiled decode path.

    base = model (never compiled); prefill = dense_prefill(base, input_ids, max_cache_len)      # once per prompt
    variant = Variant.build(base, spec)        # a weight-sharing copy of base, through lychee_compile(spec)
    scores = variant.score(prefill, target_ids) # copy of the cache, one compiled decode step per target token

The prefill is dense, eager and identical for every method (HF generate does the same: only decode steps are
compiled). Each target token after the first is fed back as the input of a decode step through
`model.get_compiled_call(model.generation_config.compile_config)`, the callable generate() uses, so the sparse
attention decides every scored prediction but the first (which comes from the dense prefill's last position).
A decode step's inputs keep their shapes from step to step and prompt to prompt (a padding mask over the whole
cache, 1 up to the new token; the cache copied into kept tensors, scratch_cache.py), as generate()'s do: one decode
graph per cache size, and a CUDA-graph capture of it is replayed rather than captured again.
After scoring, `check_sparse()` refuses any number that did not come from rewritten graphs (and, for the kernels
numerics, from the Triton kernels: numerics.py).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from ..ops.sparsity import collect_sparsity
from ..state_buffers import HEAT_ATTR
from .methods import MethodSpec
from .numerics import Numerics
from .scratch_cache import CacheScratch, scratch_for, working_copy
from ..errors import DenseFallback, SparsityNotMeasured


def dynamo_limits(recompile_limit: int = 256):
    """A context (Dynamo's own config.patch, restored on leaving) for an evaluation: each variant compiles a decode
    call of its own (install._own_compiled_call), so variants do not add up against one code object's recompile limit;
    the limits are raised for the many contexts of a run and hitting one is made an error instead of a silent
    fallback to eager (dense) execution."""
    import torch._dynamo.config as dc
    return dc.patch(recompile_limit=max(dc.recompile_limit, recompile_limit),
                    accumulated_recompile_limit=max(dc.accumulated_recompile_limit, 4 * recompile_limit),
                    fail_on_recompile_limit_hit=True)


@dataclasses.dataclass
class Prefill:
    cache: object             # transformers StaticCache holding the prompt's K/V
    last_logits: torch.Tensor  # [vocab] fp32 logits at the prompt's last position
    length: int               # prompt tokens in the cache
    max_cache_len: int        # the cache's size in tokens


@torch.no_grad()
def dense_prefill(model, input_ids: torch.Tensor, max_cache_len: int) -> Prefill:
    from transformers import StaticCache
    n = int(input_ids.shape[-1])
    if max_cache_len <= n:
        raise ValueError(f"max_cache_len {max_cache_len} leaves no room after the {n} prompt tokens")
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)    # allocated on the model's device
    device = model.device
    out = model(input_ids.to(device), past_key_values=cache, cache_position=torch.arange(n, device=device),
                use_cache=True, logits_to_keep=1)
    return Prefill(cache, out.logits[0, -1].float(), n, max_cache_len)


@dataclasses.dataclass
class TokenScores:
    logprobs: list[float]     # log p(target_i) for each target token
    hits: list[bool]          # argmax == target_i (greedy would have produced it, given the earlier targets)
    sparsity: dict | None = None   # compiled variants: ops/sparsity.py's summary over these decode steps

    @property
    def nll(self) -> float:
        return -sum(self.logprobs) / len(self.logprobs)

    @property
    def all_hit(self) -> bool:
        return all(self.hits)


@torch.no_grad()
def score_steps(call, prefill: Prefill, targets: list[int], copy_cache: bool = True,
                scratch: CacheScratch | None = None) -> TokenScores:
    """Teacher-forced: target[0] from the prefill's logits, target[i+1] from one decode step fed target[i].
    copy_cache: decode a copy of the prefill's cache (working_copy: in `scratch`'s tensors when given)."""
    cache = working_copy(prefill.cache, scratch) if copy_cache else prefill.cache
    max_len = prefill.max_cache_len
    if prefill.length + len(targets) - 1 > max_len:
        raise ValueError(f"{len(targets)} targets after {prefill.length} prompt tokens exceed the cache ({max_len})")
    logits = prefill.last_logits
    device = logits.device
    mask = torch.zeros(1, max_len, dtype=torch.long, device=device)       # the whole cache: one shape every step
    mask[:, :prefill.length] = 1
    logprobs, hits = [], []
    for i, tok in enumerate(targets):
        lp = torch.log_softmax(logits.float(), -1)
        logprobs.append(float(lp[tok]))
        hits.append(int(logits.argmax()) == tok)
        if i == len(targets) - 1:
            break
        pos = prefill.length + i
        mask[:, pos] = 1
        out = call(input_ids=torch.tensor([[tok]], device=device), cache_position=torch.tensor([pos], device=device),
                   position_ids=torch.tensor([[pos]], device=device), past_key_values=cache,
                   attention_mask=mask.clone(), use_cache=True, return_dict=True)
        logits = step_logits(out)[0]
    return TokenScores(logprobs, hits)


def step_logits(out) -> torch.Tensor:
    """The last position's logits [B, vocab] as a tensor of our own: a CUDA-graph replay's outputs are overwritten by
    the next replay."""
    return out.logits[:, -1].to(torch.float32, copy=True)


def shared_weight_copy(model):
    """A deep copy of `model` whose parameters and buffers are the same tensors (lychee_compile never changes
    weight values; it sets the generation config, attaches its state and, with fuse_linears, lays sibling weights
    out in one buffer -- the same buffer for every copy: linear_groups._fused), so each variant costs almost no
    memory."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


@dataclasses.dataclass
class Variant:
    spec: MethodSpec
    model: object
    call: object
    numerics: Numerics | None = None    # None: the base model and spec as given (nothing beyond check_sparse's check)
    tag: str = ""                       # appended to the label: "[kernels]" when several numerics run side by side
    scratch: CacheScratch | None = None  # the kept cache tensors this variant decodes in (shared per base model)

    @classmethod
    def build(cls, base, spec: MethodSpec, numerics: Numerics | None = None, tag: str = "") -> "Variant":
        """`base`: the uncompiled model (for a numerics: numerics.base_model(model)); `numerics` sets the spec's
        backend and CUDA graphs (Numerics.spec) and what check_sparse checks."""
        spec = spec if numerics is None else numerics.spec(spec)
        scratch = scratch_for(base)
        if spec.config is None:
            return cls(spec, base, base, numerics, tag, scratch)
        from ..api import lychee_compile
        model = lychee_compile(shared_weight_copy(base), spec.head_map, spec.config)
        return cls(spec, model, model.get_compiled_call(model.generation_config.compile_config), numerics, tag,
                   scratch)

    @property
    def label(self) -> str:
        return self.spec.label + self.tag

    def score(self, prefill: Prefill, targets: list[int]) -> TokenScores:
        if self.spec.config is None:
            return score_steps(self.call, prefill, targets, scratch=self.scratch)
        # What the sparse heads attend, measured by the eager reference op (ops/sparsity.py explains the choice).
        with collect_sparsity() as collector:
            scores = score_steps(self.sequence_call(), prefill, targets, scratch=self.scratch)
        if len(targets) > 1:
            self.check_sparse()
            if collector.calls:   # 0: a lowering that does not run the reference (the kernels numerics): not measured
                self._check_measured(collector.calls, len(targets) - 1)
                scores.sparsity = collector.summary()
        return scores

    def _check_measured(self, calls: int, steps: int) -> None:
        """Every decode step must have reported every global layer once; anything else would make the sparsity
        numbers wrong, so refuse. (No report at all -- a lowering that does not run the reference, e.g. Triton on bf16
        CUDA -- leaves the record's sparsity None: the tables then show no sparsity row for it.)"""
        from ..api import state_of
        want = steps * len(state_of(self.model).global_layers)
        if calls != want:
            raise SparsityNotMeasured(f"{self.label}: the sparsity collector saw {calls} op calls, expected {want} "
                                f"({steps} decode steps x {len(state_of(self.model).global_layers)} global layers). "
                                "Only the eager reference op reports them: evaluate with backend 'eager' (or fp32 "
                                "Inductor, which calls the reference).")

    def sequence_call(self):
        """The decode callable for one new sequence. The prefill ran on the base model, so the per-sequence state
        generate() would reset is reset here: the heat buffer is zeroed (heat_blocks > 0), and the compiled call is
        fetched again so a rectification wrapper (rectify_every > 0) starts with no pending tokens."""
        if self.spec.config is None:
            return self.call
        heat = getattr(self.model, HEAT_ATTR, None)
        if heat is not None:
            heat.zero_()
        return self.model.get_compiled_call(self.model.generation_config.compile_config)

    def counters(self):
        if self.spec.config is None:
            return None
        from ..api import state_of
        return state_of(self.model).counters

    def check_sparse(self) -> None:
        """Raise DenseFallback unless every compiled graph of this variant was rewritten (sparse path ran), and, for
        the kernels numerics, KernelsNotRun unless every rewritten site ran the Triton kernels."""
        c = self.counters()
        if c is None:
            return
        if c.decode_graphs == 0 or c.sites_rewritten == 0 or c.graphs_left_dense:
            raise DenseFallback(f"{self.label}: the sparse path did not run (decode graphs {c.decode_graphs}, "
                                f"sites rewritten {c.sites_rewritten}, graphs left dense {c.graphs_left_dense}, "
                                f"reasons {c.reasons}); refusing to report its numbers")
        if self.numerics is not None:
            self.numerics.check_ran(c, self.label)


@torch.no_grad()
def forward_logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Dense reference in one forward pass: log p(input_ids[t] | input_ids[:t]) for t = 1..n-1, fp32 [n - 1]."""
    logits = model(input_ids.to(model.device)).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, input_ids[0, 1:, None].to(logits.device))[:, 0]


def repeat_forward_ppl(model, tokenizer, length: int, seed: int = 0) -> float:
    """Dense perplexity of the whole second copy of [segment, segment] (the notes' repeat-test figure), one pass.
    The segment is repeat_items(...)[0]'s: with seed 0 the first `length` tokens of Persuasion."""
    import math
    from .tasks import repeat_items
    seg = repeat_items(tokenizer, length, n=1, score_tokens=1, seed=seed, score_offset=0)[0].input_ids
    lp = forward_logprobs(model, torch.cat([seg, seg], 1))
    return math.exp(-lp[length - 1:].mean().item())
