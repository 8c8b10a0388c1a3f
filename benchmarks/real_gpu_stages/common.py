"""What every stage of real_gpu.py shares: the incremental JSON report, the per-stage deadline, model loading."""
from __future__ import annotations

import json
import os
import time

import torch


class TimeUp(Exception):
    """A stage ran past its --max-seconds; what it measured so far is already in the report."""


class Deadline:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def check(self, what: str = "") -> None:
        if self.left() <= 0:
            raise TimeUp(f"stage time box of {self.seconds:.0f} s reached {what}".strip())


class Report:
    """One JSON file, rewritten atomically after every result, so a killed run loses little."""

    def __init__(self, path: str, meta: dict):
        self.path = path
        self.data = {"meta": meta, "stages": {}}
        if os.path.exists(path):                      # several device calls may fill one report
            with open(path) as f:
                old = json.load(f)
            self.data["stages"] = old.get("stages", {})
            self.data["earlier_meta"] = old.get("earlier_meta", []) + [old.get("meta")]
        self.save()

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {})

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def meta(args) -> dict:
    cuda = torch.cuda.is_available()
    import transformers
    return dict(date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch=torch.__version__,
                transformers=transformers.__version__, device=torch.cuda.get_device_name() if cuda else "cpu",
                cuda=torch.version.cuda, argv=vars(args))


def load(device: str, dtype: str):
    from lychee_compile.real_model import load_smollm2
    model, tok = load_smollm2(progress=True, device=device, dtype=getattr(torch, dtype))
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    if gc.pad_token_id is None:
        gc.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, tok


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def settled_memory() -> int:
    import gc
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def shipped_map():
    from lychee_compile.head_map import HeadMap
    from lychee_compile.training import shipped_map_path
    path = shipped_map_path()
    return HeadMap.load(str(path)), str(path)
