"""Task builders: each yields Items (a prompt prefilled densely + target tokens scored by decode steps).

- passkey_items: the real-text passkey (eval/passkey.py) at lengths x depths x trials. The assistant turn already
  holds "The pass key is" (how SmolLM2 answers), the targets are " NNNNN"; correct = every target token is the
  argmax given the earlier ones (= greedy decoding would write the key).
- repeat_items: a segment of `length` tokens of real text followed by the first `score_offset` tokens of its second
  copy (default length // 2) is prefilled; the next `score_tokens` tokens of the second copy are scored (perplexity).
  Copying needs the tokens `length` back: far context, the sharp test. (The offset matters: SmolLM2 needs some
  tokens to notice the repeat; the first 16 tokens of the second copy have perplexity ~14 even dense, at 2048.)
- text_items: perplexity of real text: `length` tokens of a book prefilled, the next `score_tokens` scored.

Prompts depend only on what the tokenizer has: a chat template wraps the passkey prompt when there is one (and
`chat_template=True`), else the raw text ends "Answer: The pass key is" (a base model, e.g. Gemma-3-270M). Tokens the
tokenizer itself puts before a text (Gemma's <bos>; none for SmolLM2 or Qwen2.5) start every prompt of every task
unless the prompt text already starts with them (prompt_prefix_ids).

Seeds are fixed: the same items for every method (paired comparison). Item seeds stay below 10000 (head-map
training uses passkey seeds >= 10000).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from .passkey import build_passkey_prompt, load_haystack_text, _normalize

ANSWER_PREFIX = "The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclasses.dataclass
class Item:
    input_ids: torch.Tensor   # [1, n] prompt, prefilled densely
    targets: list[int]        # scored by teacher-forced decode steps
    max_cache_len: int        # static cache size (fixed per task config, so compiled graphs are reused)
    meta: dict


def prompt_prefix_ids(tokenizer) -> list[int]:
    """The ids tokenizer(text) puts before the text's own tokens (e.g. [<bos>] for Gemma; [] for SmolLM2, Qwen2.5)."""
    probe = "x"
    plain = tokenizer(probe, add_special_tokens=False).input_ids
    full = tokenizer(probe).input_ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return list(full[:i])
    return []


def with_prefix(tokenizer, ids: list[int]) -> list[int]:
    """`ids` preceded by prompt_prefix_ids(tokenizer), unless they already start with them."""
    prefix = prompt_prefix_ids(tokenizer)
    return list(ids) if list(ids[:len(prefix)]) == prefix else prefix + list(ids)


def passkey_items(tokenizer, lengths=(2048,), depths=DEPTHS, trials: int = 1, seed: int = 0,
                  chat_template: bool = True, haystack: str = "persuasion") -> list[Item]:
    """`chat_template=False`: raw prompts even if the tokenizer has a template (a base model). `haystack`: a packaged
    text or a text file (eval/passkey.load_haystack_text)."""
    items = []
    for length in lengths:
        for trial in range(trials):
            for di, depth in enumerate(depths):
                item_seed = 1 + seed * 1000 + trial * len(depths) + di
                p = build_passkey_prompt(tokenizer, length, depth=depth, seed=item_seed, chat_template=chat_template,
                                         haystack=haystack)
                text = p.text if p.text.endswith(ANSWER_PREFIX) else p.text + ANSWER_PREFIX  # no chat template: there
                plain = tokenizer(text, add_special_tokens=False).input_ids
                ids = with_prefix(tokenizer, plain)
                targets = tokenizer(" " + p.passkey, add_special_tokens=False).input_ids
                items.append(Item(torch.tensor([ids]), targets, _round_up(length + length // 50 + len(targets) + 8),
                                  dict(length=length, depth=depth, trial=trial, seed=item_seed, passkey=p.passkey,
                                       prompt_tokens=len(ids),
                                       needle_token_pos=p.needle_token_pos + len(ids) - len(plain))))
    return items


@torch.no_grad()
def _book_ids(tokenizer, haystack: str) -> list[int]:
    return tokenizer(_normalize(load_haystack_text(haystack)), add_special_tokens=False).input_ids


def repeat_items(tokenizer, length: int = 2048, n: int = 4, score_tokens: int = 32, seed: int = 0,
                 haystack: str = "persuasion", score_offset: int | None = None) -> list[Item]:
    offset = length // 2 if score_offset is None else score_offset
    if not (0 < score_tokens and 0 <= offset and offset + score_tokens <= length):
        raise ValueError(f"need 0 < score_tokens and score_offset + score_tokens <= length ({length}); got "
                         f"{score_tokens} tokens at offset {offset}")
    book = _book_ids(tokenizer, haystack)
    prefix = prompt_prefix_ids(tokenizer)
    rng = random.Random(seed)
    items = []
    for i in range(n):
        start = 0 if (i == 0 and seed == 0) else rng.randint(0, len(book) - length - 1)
        seg = book[start:start + length]
        items.append(Item(torch.tensor([prefix + seg + seg[:offset]]), seg[offset:offset + score_tokens],
                          _round_up(len(prefix) + length + offset + score_tokens),
                          dict(length=length, start=start, score_offset=offset, score_tokens=score_tokens, index=i)))
    return items


def text_items(tokenizer, length: int = 2048, n: int = 4, score_tokens: int = 32, seed: int = 0,
               haystack: str = "persuasion") -> list[Item]:
    book = _book_ids(tokenizer, haystack)
    prefix = prompt_prefix_ids(tokenizer)
    rng = random.Random(seed + 7919)
    items = []
    for i in range(n):
        start = rng.randint(0, len(book) - length - score_tokens - 1)
        ids = book[start:start + length]
        items.append(Item(torch.tensor([prefix + ids]), book[start + length:start + length + score_tokens],
                          _round_up(len(prefix) + length + score_tokens), dict(length=length, start=start,
                                                                 score_tokens=score_tokens, index=i)))
    return items


def _round_up(n: int, to: int = 64) -> int:
    return -(-n // to) * to


TASKS = {"passkey": passkey_items, "repeat": repeat_items, "ppl": text_items}
NOT_DONE_TASKS: dict[str, str] = {}   # task name -> why it is not available (none at present)
