"""RULER-style synthetic tasks over the real-text haystack, as Items for the same teacher-forced scorer.

- multikey_items: K needles "One of the special magic numbers for <word> is: <7 digits>." at spread depths; the
  question asks for one key's number (RULER niah_multikey). Target: " <digits>".
- multivalue_items: V numbers for the same key (RULER niah_multivalue); target: the numbers in document order,
  ", "-separated (a strict order: a model listing them in another order counts as wrong).
- vartrack_items: a chain "VAR A = 12345." -> "VAR B = VAR A." -> ... spread through the text (RULER variable
  tracking); the question asks for every variable holding the value; target: the names in chain order.

- cwe_items: common-words extraction (RULER cwe): a numbered list of words from the haystack book's vocabulary in
  which `common` words appear `common_freq` times each and every other word `rare_freq` times; the question asks
  for the `common` most frequent words in order of first appearance (stated in the question, so the target is
  one string); target: the words ", "-separated.
Scoring = every target token is the argmax (greedy would write it) plus the mean NLL, like passkey. Seeds are
fixed and below 10000.
"""
from __future__ import annotations

import random

import torch

from .passkey import _compose, _normalize, load_haystack_text
from .tasks import Item, _round_up

KEY_WORDS = ("apple", "river", "candle", "mirror", "falcon", "garden", "silver", "harbor", "lantern", "meadow",
             "pepper", "thunder", "violet", "whisper", "copper", "orchid")
VAR_NAMES = ("XKQ", "MBT", "ZLW", "HVR", "PDN", "QJS", "WFC", "NRG", "TYB", "LMX")


def _needles_prompt(tokenizer, target_tokens: int, needles: list[str], question: str, answer_prefix: str,
                    seed: int, haystack: str = "persuasion"):
    """(token ids, needle depths) of a prompt of ~target_tokens with `needles` in order at evenly spread depths."""
    rng = random.Random(seed)
    book = _normalize(load_haystack_text(haystack))
    book_ids = tokenizer(book, add_special_tokens=False).input_ids
    start = rng.randint(0, max(0, len(book_ids) - target_tokens))
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles)
    instruction = ("Some special information is hidden inside a lot of irrelevant text. Find it and memorize it. "
                   "I will quiz you about it.")

    def render(n_hay: int):
        hay = tokenizer.decode(book_ids[start:start + n_hay]).strip()
        body = hay
        for needle, depth in reversed(list(zip(needles, depths))):   # deepest first: earlier cuts stay valid
            body = _compose(body, needle, depth)
        text = _wrap(tokenizer, f"{instruction}\n\n{body}\n\n{question}") + answer_prefix
        return tokenizer(text, add_special_tokens=False).input_ids

    overhead = len(render(0))
    if target_tokens <= overhead + 16:
        raise ValueError(f"target_tokens={target_tokens} leaves no room for a haystack ({overhead} fixed tokens)")
    n_hay = target_tokens - overhead
    ids = render(n_hay)
    for _ in range(6):
        if abs(len(ids) - target_tokens) <= max(1, target_tokens // 100):
            break
        n_hay += target_tokens - len(ids)
        ids = render(n_hay)
    return ids, depths


def _wrap(tokenizer, user_text: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                             add_generation_prompt=True)
    return user_text + "\nAnswer: "


def _item(tokenizer, ids, answer: str, length: int, meta: dict) -> Item:
    targets = tokenizer(answer, add_special_tokens=False).input_ids
    return Item(torch.tensor([ids]), targets, _round_up(length + length // 50 + len(targets) + 8), meta)


def multikey_items(tokenizer, length: int = 2048, n: int = 4, keys: int = 4, seed: int = 0) -> list[Item]:
    items = []
    for i in range(n):
        s = 2000 + seed * 100 + i
        rng = random.Random(s)
        words = rng.sample(KEY_WORDS, keys)
        values = [str(rng.randint(10**6, 10**7 - 1)) for _ in words]
        needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
        q = rng.randrange(keys)
        ids, depths = _needles_prompt(tokenizer, length, needles,
                                      f"What is the special magic number for {words[q]}? Answer with the number only.",
                                      f"The special magic number for {words[q]} is:", s)
        items.append(_item(tokenizer, ids, " " + values[q], length,
                           dict(task="multikey", length=length, seed=s, key=words[q], answer=values[q],
                                depth=round(depths[q], 3), keys=keys)))
    return items


def multivalue_items(tokenizer, length: int = 2048, n: int = 4, values: int = 3, seed: int = 0) -> list[Item]:
    items = []
    for i in range(n):
        s = 3000 + seed * 100 + i
        rng = random.Random(s)
        word = rng.choice(KEY_WORDS)
        vals = [str(rng.randint(10**6, 10**7 - 1)) for _ in range(values)]
        needles = [f"One of the special magic numbers for {word} is: {v}." for v in vals]
        ids, _ = _needles_prompt(tokenizer, length, needles,
                                 f"What are all the special magic numbers for {word}? List them in order.",
                                 f"The special magic numbers for {word} are:", s)
        items.append(_item(tokenizer, ids, " " + ", ".join(vals), length,
                           dict(task="multivalue", length=length, seed=s, key=word, answer=vals)))
    return items


def vartrack_items(tokenizer, length: int = 2048, n: int = 4, hops: int = 3, seed: int = 0) -> list[Item]:
    items = []
    for i in range(n):
        s = 4000 + seed * 100 + i
        rng = random.Random(s)
        names = rng.sample(VAR_NAMES, hops + 1)
        value = str(rng.randint(10000, 99999))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
        ids, _ = _needles_prompt(tokenizer, length, needles,
                                 f"Find all variables that are assigned the value {value}, in the order of the text.",
                                 f"The variables assigned the value {value} are:", s)
        items.append(_item(tokenizer, ids, " " + ", ".join(names), length,
                           dict(task="vartrack", length=length, seed=s, value=value, answer=names)))
    return items


def _book_vocabulary(haystack: str = "persuasion") -> list[str]:
    """Distinct lower-case alphabetic words of 4-9 letters of the book, sorted (deterministic)."""
    words = _normalize(load_haystack_text(haystack)).lower().split()
    return sorted({w for w in words if w.isalpha() and 4 <= len(w) <= 9})


def _cwe_prompt(tokenizer, target_tokens: int, common: list[str], rare_pool: list[str], common_freq: int,
                rare_freq: int, rng: random.Random, prefix: str):
    """(token ids, the word list) of ~target_tokens: common words x common_freq + n rare words x rare_freq, shuffled,
    n grown until the prompt reaches the target length."""
    question = (f"What are the {len(common)} most common words in the above list? Answer with the words in the "
                "order of their first appearance in the list.")
    order = list(range(len(rare_pool)))
    rng.shuffle(order)
    shuffle_seed = rng.randrange(10**6)

    def render(n_rare: int):
        entries = common * common_freq + [rare_pool[i] for i in order[:n_rare]] * rare_freq
        random.Random(shuffle_seed).shuffle(entries)
        listing = "\n".join(f"{j + 1}. {w}" for j, w in enumerate(entries))
        text = _wrap(tokenizer, f"Below is a numbered list of words.\n\n{listing}\n\n{question}") + prefix
        return tokenizer(text, add_special_tokens=False).input_ids, entries

    if len(render(0)[0]) > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} cannot even hold the common words x {common_freq}; "
                         "lower common / common_freq or raise the length")
    lo, hi = 0, len(rare_pool)
    while lo < hi:                                          # the largest n_rare whose prompt fits the target
        mid = (lo + hi + 1) // 2
        if len(render(mid)[0]) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    return render(lo)


def cwe_items(tokenizer, length: int = 2048, n: int = 4, common: int = 5, common_freq: int = 20, rare_freq: int = 2,
              seed: int = 0) -> list[Item]:
    vocab = _book_vocabulary()
    items = []
    for i in range(n):
        s = 5000 + seed * 100 + i
        rng = random.Random(s)
        chosen = rng.sample(vocab, len(vocab))
        words, rare_pool = chosen[:common], chosen[common:]
        ids, entries = _cwe_prompt(tokenizer, length, words, rare_pool, common_freq, rare_freq, rng,
                                   f"The {common} most common words in the list are:")
        answer = sorted(words, key=entries.index)              # order of first appearance
        items.append(_item(tokenizer, ids, " " + ", ".join(answer), length,
                           dict(task="cwe", length=length, seed=s, answer=answer, common_freq=common_freq,
                                rare_freq=rare_freq, list_words=len(entries))))
    return items


RULER_TASKS = {"cwe": cwe_items, "multikey": multikey_items, "multivalue": multivalue_items, "vartrack": vartrack_items}
