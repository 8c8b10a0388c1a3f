"""Stage `long`: thousands of decode steps of the real SmolLM2 through lychee_compile (shipped map, static
cache), checked for NaN/Inf logits, recompiles, memory growth and state leaks between generate() calls.

Two generate() calls on the same real-text passkey prompt, `steps` new tokens each (greedy, min_new_tokens = steps so
EOS cannot end a call early); the second must reproduce the first token for token. A dense generate() (HF compiled,
static cache) of the same prompt gives the reference tokens and TPOT.
"""
from __future__ import annotations

import glob
import os
import time

import torch

from .common import Deadline, load, log, settled_memory, shipped_map, sync


class Clock:
    """generate() streamer: a synchronized timestamp per emitted token."""

    def __init__(self):
        self.stamps = []

    def put(self, _tokens):
        sync()
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def tpot_ms(self) -> float:
        half = self.stamps[len(self.stamps) // 2:]
        gaps = sorted(b - a for a, b in zip(half, half[1:]))
        return gaps[len(gaps) // 2] * 1e3 if gaps else float("nan")


def _generate(model, ids, steps, **kw):
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)
    sync()
    return out, time.perf_counter() - t0


def _finite(logits) -> dict:
    bad = [i for i, x in enumerate(logits) if not bool(torch.isfinite(x).all())]
    return dict(steps=len(logits), nonfinite_steps=len(bad), first_nonfinite_step=bad[0] if bad else None)


def _kernel_files() -> dict:
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        return {"note": "TORCHINDUCTOR_CACHE_DIR not set: generated code not searched"}
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    text = {p: open(p, errors="replace").read() for p in files}
    return dict(inductor_py_files=len(files),
                with_split_kernel=sum("lychee_hybrid_split" in t for t in text.values()),
                with_combine_kernel=sum("lychee_hybrid_combine" in t for t in text.values()),
                with_reference_extern=sum("lychee.hybrid_decode" in t for t in text.values()))


def run(args, report, device: str) -> None:
    res = report.stage("long")
    dl = Deadline(args.max_seconds)
    from lychee_compile import LycheeConfig, lychee_compile
    from lychee_compile.api import state_of
    from lychee_compile.eval.passkey import build_passkey_prompt

    model, tok = load(device, args.long_dtype)
    prompt = build_passkey_prompt(tok, args.long_context, depth=0.5, seed=4242)
    ids = prompt.input_ids.to(device)
    hm, where = shipped_map()
    cfg = LycheeConfig(budget=args.long_budget, backend=args.backend)
    res.update(dtype=args.long_dtype, backend=args.backend, prompt_tokens=ids.shape[1], steps_per_call=args.steps,
               head_map=where, config=repr(cfg), passkey=prompt.passkey)
    report.save()
    lychee_compile(model, hm, cfg)
    res["config"] = repr(state_of(model).config)      # as resolved for this model (cuda_graphs decided)
    counters = state_of(model).counters
    seqs = []
    for call in range(args.long_calls):
        dl.check(f"before generate() call {call + 1}")
        clock = Clock()
        out, wall = _generate(model, ids, args.steps, streamer=clock)
        fin = _finite(out.logits)
        seqs.append(out.sequences.cpu())
        del out
        mem = settled_memory()
        row = dict(call=call + 1, wall_s=round(wall, 2), tpot_ms=clock.tpot_ms(), memory_allocated_mb=mem / 2**20,
                   graphs=counters.graphs, decode_graphs=counters.decode_graphs, decode_calls=counters.decode_calls,
                   sites_rewritten=counters.sites_rewritten, graphs_left_dense=counters.graphs_left_dense, **fin)
        res.setdefault("calls", []).append(row)
        log(f"long: call {call + 1}: {row}")
        report.save()
    _verdicts(res, seqs, tok, ids.shape[1])
    res["generated_code"] = _kernel_files()
    report.save()
    _dense(args, res, report, tok, ids, seqs[0], dl, device)


def _verdicts(res, seqs, tok, n_prompt) -> None:
    calls = res["calls"]
    from lychee_compile.eval.passkey import score_passkey
    res["text_first_200_chars"] = tok.decode(seqs[0][0, n_prompt:], skip_special_tokens=False)[:200]
    res["first_200_chars_name_the_passkey"] = score_passkey(res["text_first_200_chars"], res["passkey"])
    res["checks"] = dict(
        all_logits_finite=all(c["nonfinite_steps"] == 0 for c in calls),
        one_decode_graph=calls[-1]["decode_graphs"] == 1,
        no_compile_after_first_call=len({c["graphs"] for c in calls}) == 1,
        no_graph_left_dense=calls[-1]["graphs_left_dense"] == 0,
        memory_flat_mb=calls[-1]["memory_allocated_mb"] - calls[0]["memory_allocated_mb"],
        repeat_calls_identical=all(torch.equal(seqs[0], s) for s in seqs[1:]))
    log(f"long: checks {res['checks']}")


def _dense(args, res, report, tok, ids, lychee_seq, dl, device) -> None:
    """HF as-is (compiled, static cache): reference tokens and TPOT for the same prompt and step count."""
    dl.check("before the dense reference")
    from transformers import CompileConfig
    model, _ = load(device, args.long_dtype)
    cc = CompileConfig(fullgraph=True, mode=None)
    cc._compile_all_devices = True
    out, wall = _generate(model, ids, args.steps, cache_implementation="static", compile_config=cc)
    dense_seq = out.sequences.cpu()
    del out
    clock = Clock()
    if dl.left() > 0:
        _generate(model, ids, args.steps, cache_implementation="static", compile_config=cc, streamer=clock)
    new_d, new_l = dense_seq[0, ids.shape[1]:], lychee_seq[0, ids.shape[1]:]
    same = (new_d == new_l).long()
    res["dense"] = dict(first_call_wall_s=round(wall, 2), tpot_ms=clock.tpot_ms(),
                        tokens_equal_prefix=int(same.cumprod(0).sum()), tokens_equal_total=int(same.sum()),
                        text_first_200_chars=tok.decode(new_d, skip_special_tokens=False)[:200])
    log(f"long: dense {res['dense']}")
    report.save()
