"""Passkey retrieval: a needle with a 5-digit key hidden at a given depth in real text, the question at the end.

    prompt = build_passkey_prompt(tokenizer, target_tokens=3000, depth=0.5, seed=0)
    result = run_passkey(model, tokenizer, prompt)          # greedy generate, timed
    result.correct, result.answer, result.decode_tokens_per_s  # steady decode rate

The haystack is real prose (Jane Austen's *Persuasion*, public domain, shipped in lychee_compile/data), not repeated
filler: a model that loses far context cannot find the key by pattern matching on repetition. The needle is
"The pass key is NNNNN. Remember it. NNNNN is the pass key.", inserted at a sentence boundary near `depth` (0 = start
of the haystack, 1 = end). The prompt is wrapped in the tokenizer's chat template when it has one.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from functools import lru_cache
from importlib import resources

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.")
QUESTION = "What is the pass key? Answer with the number only."
HAYSTACKS = {"persuasion": "persuasion.txt"}


@lru_cache(maxsize=None)
def load_haystack_text(name: str = "persuasion") -> str:
    """The packaged public-domain text `name` (see HAYSTACKS), or the UTF-8 text file at path `name`, as one
    string."""
    if name not in HAYSTACKS:
        if os.path.isfile(name):      # a user's own text (lychee calibrate --text FILE)
            with open(name, encoding="utf-8") as f:
                return f.read()
        raise ValueError(f"unknown haystack {name!r}: neither a packaged text ({sorted(HAYSTACKS)}) nor a file")
    return resources.files("lychee_compile").joinpath("data", HAYSTACKS[name]).read_text(encoding="utf-8")


@dataclasses.dataclass
class PasskeyPrompt:
    text: str                 # the full prompt (chat template applied), ready to tokenize without special tokens
    input_ids: "object"       # torch.LongTensor [1, n_tokens]
    passkey: str
    depth: float              # requested depth
    needle_token_pos: int     # approximate token index where the needle starts
    target_tokens: int

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def _normalize(text: str) -> str:
    # Hard-wrapped lines and blank-line paragraphs -> single spaces / paragraph breaks (fewer, more natural tokens).
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def _wrap(tokenizer, user_text: str, chat_template: bool) -> str:
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                             add_generation_prompt=True)
    return user_text + "\nAnswer: The pass key is"


def _compose(haystack: str, needle: str, depth: float) -> str:
    """Insert the needle at the first sentence end at/after `depth` of the haystack's characters."""
    cut = int(len(haystack) * min(max(depth, 0.0), 1.0))
    if 0 < cut < len(haystack):
        match = re.compile(r"[.!?][\"']?\s").search(haystack, cut)
        cut = match.end() if match else len(haystack)
    before, after = haystack[:cut].rstrip(), haystack[cut:].lstrip()
    return " ".join(part for part in (before, needle, after) if part)


def build_passkey_prompt(tokenizer, target_tokens: int, depth: float = 0.5, seed: int = 0,
                         passkey: str | None = None, haystack: str = "persuasion",
                         chat_template: bool = True, tolerance: float = 0.01) -> PasskeyPrompt:
    """A passkey prompt of `target_tokens` tokens (within `tolerance`, usually a few tokens) for `tokenizer`.

    `seed` picks the passkey (unless given) and where in the book the haystack starts.
    """
    import torch

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = passkey if passkey is not None else str(rng.randint(10000, 99999))
    needle = NEEDLE.format(key=key)
    book = _normalize(load_haystack_text(haystack))
    book_ids = tokenizer(book, add_special_tokens=False).input_ids

    # Where in the book the haystack starts: the beginning for seed 0, else a seeded offset that leaves room.
    start = 0 if seed == 0 else rng.randint(0, max(0, len(book_ids) - target_tokens))

    def render(n_hay: int) -> tuple[str, list[int], int]:
        hay_ids = (book_ids * (1 + (start + n_hay) // len(book_ids)))[start:start + n_hay]
        hay = tokenizer.decode(hay_ids).strip()
        body = _compose(hay, needle, depth)
        text = _wrap(tokenizer, f"{INSTRUCTION}\n\n{body}\n\n{QUESTION}", chat_template)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return text, ids, body.find(needle)

    overhead = len(render(0)[1])
    if target_tokens <= overhead + 8:
        raise ValueError(f"target_tokens={target_tokens} leaves no room for a haystack (the template, instruction, "
                         f"needle and question take {overhead} tokens)")
    n_hay = target_tokens - overhead
    text, ids, _ = render(n_hay)
    for _ in range(6):  # re-tokenization at the seams moves the count by a few tokens; converge
        if abs(len(ids) - target_tokens) <= max(1, int(tolerance * target_tokens)):
            break
        n_hay += target_tokens - len(ids)
        text, ids, _ = render(n_hay)
    needle_char = text.find(needle)
    needle_tok = len(tokenizer(text[:needle_char], add_special_tokens=False).input_ids)
    return PasskeyPrompt(text=text, input_ids=torch.tensor([ids], dtype=torch.long), passkey=key, depth=depth,
                         needle_token_pos=needle_tok, target_tokens=target_tokens)


def score_passkey(answer: str, passkey: str) -> bool:
    """True if the answer contains the passkey as a whole number (not as part of a longer digit run)."""
    return re.search(rf"(?<!\d){re.escape(str(passkey))}(?!\d)", answer) is not None


@dataclasses.dataclass
class PasskeyResult:
    answer: str
    correct: bool
    new_tokens: int
    prefill_s: float          # generate() start -> first generated token (prefill)
    first_step_s: float       # first -> second generated token: the first decode step (where torch.compile compiles)
    steady_s: float           # second -> last generated token: decode steps after the first
    total_s: float
    token_ids: list

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady decode rate: tokens per second after the first decode step (so a compile there is excluded)."""
        n = self.new_tokens - 2
        return n / self.steady_s if n > 0 and self.steady_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole generate() call (prefill and any compile included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")


class _TimingStreamer:
    """generate() calls put() once with the prompt, then once per new token: timestamps split prefill / decode."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_passkey(model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int = 16, **generate_kwargs) -> PasskeyResult:
    """Greedy generation on the prompt; the answer is scored against the passkey."""
    import torch

    streamer = _TimingStreamer()
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    kwargs.update(generate_kwargs)
    ids = prompt.input_ids.to(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    total = time.perf_counter() - start
    new = out[0, ids.shape[-1]:].tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    t = streamer.times  # t[0]: prompt handed over, t[i]: i-th new token out
    prefill = (t[1] - start) if len(t) > 1 else total
    first_step = (t[2] - t[1]) if len(t) > 2 else float("nan")
    steady = (t[-1] - t[2]) if len(t) > 3 else 0.0
    return PasskeyResult(answer=answer, correct=score_passkey(answer, prompt.passkey), new_tokens=len(new),
                         prefill_s=prefill, first_step_s=first_step, steady_s=steady, total_s=total, token_ids=new)
