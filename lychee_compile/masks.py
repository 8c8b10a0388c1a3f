"""The padding masks a lychee model's generate() takes, checked before any work.

The rewritten decode step reads each row's valid cache positions as one range, from the row's first valid position
to the end of what is written (the kernels' per-row extents; ops/reference.py masks the same way). generate()
extends the mask by one valid position per new token, so a row keeps one range exactly when its prompt mask is
padding first, then only valid positions: left padding (tokenizers' padding_side="left"), or none. Anything else
would give each step a hole the sparse paths do not see, so it is refused by name:
  * a hole inside a prompt ([1, 0, 1, 1]);
  * right padding ([1, 1, 0, 0]: the first new token would open a hole after the prompt);
  * a row with no valid position, or a mask that is not 2-D [batch, prompt length].
"""
from __future__ import annotations

import torch

from .errors import LycheeCompileError


def check_padding_mask(mask) -> None:
    """mask: [B, T] (1 / True = a real token) or None (no padding). Raises LycheeCompileError naming the rows."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise LycheeCompileError(f"lychee_compile's generate() takes a 2-D padding mask [batch, prompt length], got "
                                 f"{shape}; custom (4-D) attention masks are not supported by the rewritten step.")
    if mask.shape[1] == 0:
        raise LycheeCompileError("attention_mask has no positions (shape [batch, 0]): a prompt needs at least one "
                                 "token.")
    valid = mask.to(torch.bool)
    empty = ~valid.any(dim=1)
    right = valid.any(dim=1) & ~valid[:, -1]
    hole = (valid[:, :-1] & ~valid[:, 1:]).any(dim=1) & ~right      # a valid position followed by padding
    for rows, what, fix in ((empty, "have no valid position", "drop them"),
                            (right, "are right-padded", "pad on the left (tokenizer.padding_side = 'left')"),
                            (hole, "have padding between valid positions",
                             "remove the hole, or run those prompts without lychee_compile")):
        if rows.any():
            raise LycheeCompileError(f"attention_mask rows {rows.nonzero().flatten().tolist()} {what}: the rewritten "
                                     f"decode step reads each row's valid positions as one range ending at the "
                                     f"newest token; {fix}.")
