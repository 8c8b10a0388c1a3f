"""Calibration and held-out prompt sets, built by eval/tasks.py's builders over the calibration text.

    items = prompt_set(tokenizer, "passkey", lengths=[2048], n=10, seed=SEARCH_SEED, text="persuasion")

Search and certification draw from different seeds (SEARCH_SEED, CERTIFY_SEED; the task builders derive every
prompt from its seed); `check_disjoint` refuses two sets that share a prompt. Passkey prompt seeds are
1 + 1000 * seed + i (eval/tasks.passkey_items): seeds 50 and 60 give 50001.. and 60001.., apart from `lychee eval`
(seed 0: 1..999) and head-map training (10000 + 1000 * data seed + i) unless a map was trained with data seed 40 or 50.
"""
from __future__ import annotations

import hashlib

from ..eval.tasks import DEPTHS, passkey_items, repeat_items, text_items

SEARCH_SEED = 50
CERTIFY_SEED = 60


def prompt_set(tokenizer, task: str, lengths: list[int], n: int, seed: int, text: str = "persuasion",
               score_tokens: int = 16, chat_template: bool = True) -> list:
    """`n` prompts per length (passkey: depths 0.1..0.9 cycling)."""
    items = []
    for length in lengths:
        if task == "passkey":
            trials = -(-n // len(DEPTHS))
            items += passkey_items(tokenizer, [length], DEPTHS, trials, seed, chat_template=chat_template,
                                   haystack=text)[:n]
        elif task == "ppl":
            items += text_items(tokenizer, length, n, score_tokens, seed + length, haystack=text)
        elif task == "repeat":
            items += repeat_items(tokenizer, length, n, score_tokens, seed + length, haystack=text)
        else:
            raise ValueError(f"unknown calibration task {task!r}")
    return items


def _identity(item) -> tuple:
    return tuple(item.input_ids[0].tolist()), tuple(item.targets)


def check_disjoint(search: list, held_out: list) -> None:
    shared = {_identity(i) for i in search} & {_identity(i) for i in held_out}
    if shared:
        raise ValueError(f"{len(shared)} held-out prompts also occur in the search set; pick another certify seed")


def digest(text: str, *item_sets) -> str:
    """sha256 (16 hex) of the calibration text and every prompt's token ids and targets, in order."""
    from ..eval.passkey import load_haystack_text
    h = hashlib.sha256(load_haystack_text(text).encode("utf-8"))
    for items in item_sets:
        for it in items:
            h.update(repr(_identity(it)).encode())
    return h.hexdigest()[:16]
