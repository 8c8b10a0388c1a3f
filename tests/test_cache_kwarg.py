"""cache_kwarg: the cache argument is found under transformers' old name (past_key_values, <= 5.23) and its new one
(cache, 5.24+), and a call we make names it as the model's forward does."""
import pytest
import torch

from lychee_compile.cache_kwarg import cache_kwarg, cache_of


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_cache_of_reads_either_name(name):
    cache = object()
    assert cache_of({name: cache, "attention_mask": None}) is cache
    assert cache_of({name: None}) is None and cache_of({}) is None


def test_cache_kwarg_follows_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False, **kwargs):
            return cache

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return kwargs

    assert (cache_kwarg(Old()), cache_kwarg(New()), cache_kwarg(Neither())) == ("past_key_values", "cache",
                                                                              "past_key_values")
    marker = object()
    for m in (Old(), New()):
        assert m(None, **{cache_kwarg(m): marker}) is marker
