"""Which token ids a tokenizer gives a text, as a count and a sha256, to compare transformers versions (run it once
under each and compare the lines): the tokenizer converted from a GGUF by this transformers, or one saved in a folder.

    python benchmarks/probes/tokenizer_ids.py --gguf PATH/qwen2.5-coder-0.5b-instruct.gguf
    python benchmarks/probes/tokenizer_ids.py --folder TOKENIZER_FOLDER --chars 200000

Prints the transformers version, the probe sentence's token count (lychee_compile.real_model.check_tokenizer's rule),
the fingerprint calibrate records, the count and sha256 (12 hex) of the ids of the first --chars characters of the
shipped haystack (Persuasion), and the sha256 of a one-message chat template's ids where the tokenizer has one.
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path


def _sha(ids) -> str:
    return hashlib.sha256(repr(list(ids)).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="a GGUF file: its tokenizer as this transformers converts it")
    src.add_argument("--folder", help="a folder holding a saved tokenizer")
    ap.add_argument("--chars", type=int, default=200_000, help="characters of the haystack to tokenize")
    args = ap.parse_args()
    import transformers
    from transformers import AutoTokenizer

    from lychee_compile.eval.passkey import load_haystack_text
    from lychee_compile.real_model import TOKENIZER_PROBE, tokenizer_fingerprint
    if args.gguf:
        path = Path(args.gguf).expanduser()
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(Path(args.folder).expanduser())
    ids = tok(load_haystack_text("persuasion")[:args.chars]).input_ids
    chat = "none"
    if getattr(tok, "chat_template", None):
        chat = _sha(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    print(f"transformers {transformers.__version__}: probe {len(tok(TOKENIZER_PROBE).input_ids)} tokens, fingerprint "
          f"{tokenizer_fingerprint(tok)}; haystack[:{args.chars}] {len(ids)} tokens sha {_sha(ids)}; chat {chat}")


if __name__ == "__main__":
    main()
