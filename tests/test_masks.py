"""Padding masks (lychee_compile/masks.py): left padding runs; a hole inside a prompt, right padding, an empty row or
a non-2-D mask is refused by generate() before any work -- no forward runs -- on either backend."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile.masks import check_padding_mask
from lychee_compile import LycheeCompileError
from tests.harness import generate_logits
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

OK = {"left padding": [[0, 0, 1, 1], [1, 1, 1, 1]], "bool": [[False, True, True, True]]}
REFUSED = {"hole": ([[1, 1, 1, 1], [0, 1, 0, 1]], "rows [1] have padding between valid positions"),
           "right padding": ([[1, 1, 0, 0]], "rows [0] are right-padded"),
           "empty row": ([[0, 0, 0, 0], [1, 1, 1, 1]], "rows [0] have no valid position")}


@pytest.mark.parametrize("name", sorted(OK))
def test_left_padded_masks_pass(name):
    check_padding_mask(torch.tensor(OK[name]))
    check_padding_mask(None)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_bad_masks_are_refused_by_name(name):
    mask, message = REFUSED[name]
    with pytest.raises(LycheeCompileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_padding_mask(torch.tensor(mask))
    with pytest.raises(LycheeCompileError, match="2-D padding mask"):
        check_padding_mask(torch.ones(1, 1, 4, 4))


@pytest.mark.parametrize("backend", ["eager", "inductor", "interpreted kernels"])
def test_generate_refuses_a_hole_before_any_forward(backend, request):
    # "interpreted kernels": bf16 through Inductor's Triton code generation on CPU (the Triton interpreter), the path
    # a CUDA model takes; after the refusal the same model decodes the left-padded batch on the kernels
    kernels = backend == "interpreted kernels"
    if kernels:
        request.getfixturevalue("inductor_triton_on_cpu")
    model = make("llama", "sdpa").to(torch.bfloat16 if kernels else torch.float32)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                   LycheeConfig(budget=8, block_size=4, sink_tokens=2, local_tokens=2,
                                backend="inductor" if kernels else backend))
    ids, mask = make_batch(lengths=(12, 9))
    holed = mask.clone()
    holed[1, 6] = 0                      # row 1's prompt is positions 3..11: a hole at 6
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(LycheeCompileError, match=r"rows \[1\] have padding between valid positions"):
        generate_logits(model, ids, holed, 3)
    assert forwards == [] and state_of(model).counters.decode_calls == 0
    if backend != "inductor":            # the same model still generates from the left-padded mask
        generate_logits(model, ids, mask, 3)
        assert state_of(model).counters.decode_calls == 2 and len(forwards) == 3
    if kernels:
        counters = state_of(model).counters
        assert counters.sites_on_kernel == counters.sites_rewritten > 0 and counters.sites_on_reference == 0
