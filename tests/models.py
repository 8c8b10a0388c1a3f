"""Tiny random-init Hugging Face decoders for tests (CPU, fp32, seconds to build and run).

Every factory returns a seeded, fp32, ``eval()`` model with vocab 128, a few layers and head_dim 16 (phi3_d96: 96;
phi_d80: 80; olmo2: 8), built from the config class directly (no hub). The same kwargs work on transformers 5.17 and
5.23 (checked on both).

    from tests.models import ARCHS, make, make_batch
    model = make("qwen2_gqa7", "sdpa")
    input_ids, attention_mask = make_batch()            # 2 left-padded prompts of lengths 12 and 7

Arch keys and what each one exercises:
    llama            GQA 2 (4 q / 2 kv heads)
    qwen2_gqa7       GQA 7 (14 q / 2 kv heads, head_dim 16 set explicitly: hidden 64 is not 14 * 16)
    qwen3            q/k RMSNorm, GQA 2
    mistral          no sliding window
    mistral_swa      sliding_window=8 on every layer (shorter than the test context)
    gemma3           text-only Gemma3ForCausalLM; layer_types sliding/full/sliding/full (2 global layers),
                     sliding_window=8, query_pre_attn_scalar != head_dim (scaling is not 1/sqrt(d)), MQA
    phi3             fused qkv_proj, MHA
    phi3_d96         head_dim 96 (hidden 384 / 4 heads; not a power of two), GQA 2
    phi_d80          Phi-2-like: head_dim 80 (hidden 160 / 2 heads), MHA, partial rotary, parallel residual
    gpt_neox         MHA, fused query_key_value, partial rotary (rotary_pct 0.25), parallel residual
    granite          attention_multiplier 0.1 as the attention scale, GQA 2
    olmo2            head_dim 8 (8 q / 4 kv heads), q/k RMSNorm over the whole projection
"""
from __future__ import annotations

import torch

VOCAB = 128
HIDDEN = 64
HEAD_DIM = 16
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Sliding window used by mistral_swa and gemma3: shorter than make_batch()'s longest prompt + 4 new tokens.
SLIDING_WINDOW = 8
ATTN_IMPLS = ("sdpa", "eager")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)


def _finish(model_cls, config, attn_impl: str, seed: int):
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    config._attn_implementation = attn_impl
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # Random weights may emit EOS at any step; never stop early, so every run has exactly max_new_tokens tokens.
    gc = model.generation_config
    gc.pad_token_id = PAD_ID
    gc.bos_token_id = BOS_ID
    gc.eos_token_id = None
    gc.do_sample = False
    return model


def make_llama(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=HEAD_DIM)
    return _finish(LlamaForCausalLM, cfg, attn_impl, seed)


def make_qwen2_gqa7(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**_COMMON, num_hidden_layers=3, num_attention_heads=14, num_key_value_heads=2,
                      head_dim=HEAD_DIM, use_sliding_window=False)
    return _finish(Qwen2ForCausalLM, cfg, attn_impl, seed)


def make_qwen3(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=HEAD_DIM, use_sliding_window=False)
    return _finish(Qwen3ForCausalLM, cfg, attn_impl, seed)


def make_mistral(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=HEAD_DIM, sliding_window=None)
    return _finish(MistralForCausalLM, cfg, attn_impl, seed)


def make_mistral_swa(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW)
    return _finish(MistralForCausalLM, cfg, attn_impl, seed)


def make_gemma3(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    common = dict(_COMMON, tie_word_embeddings=True)  # Gemma ties embeddings
    cfg = Gemma3TextConfig(
        **common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,  # scaling = 32**-0.5, deliberately != head_dim**-0.5
    )
    return _finish(Gemma3ForCausalLM, cfg, attn_impl, seed)


def make_phi3(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Phi3Config, Phi3ForCausalLM
    # hidden 64 / 4 heads = head_dim 16 (Phi3 derives head_dim from hidden_size / num_attention_heads).
    cfg = Phi3Config(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     original_max_position_embeddings=256)
    return _finish(Phi3ForCausalLM, cfg, attn_impl, seed)


def make_phi3_d96(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Phi3Config, Phi3ForCausalLM
    # head_dim 96 as in Phi-3-mini: hidden 384 / 4 heads (Phi3 derives head_dim from hidden_size / heads)
    cfg = Phi3Config(**dict(_COMMON, hidden_size=4 * 96), num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, original_max_position_embeddings=256)
    return _finish(Phi3ForCausalLM, cfg, attn_impl, seed)


def make_phi_d80(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import PhiConfig, PhiForCausalLM
    # head_dim 80 as in Phi-2: hidden 160 / 2 heads; partial rotary (0.4 of the head dim), parallel attention + MLP
    cfg = PhiConfig(**dict(_COMMON, hidden_size=2 * 80), num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=2, partial_rotary_factor=0.4)
    return _finish(PhiForCausalLM, cfg, attn_impl, seed)


def make_gpt_neox(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    # hidden 64 / 4 heads = head_dim 16; rotary_pct 0.25 -> 4 rotary dims per head (partial rotary).
    cfg = GPTNeoXConfig(**_COMMON, num_hidden_layers=3, num_attention_heads=4, rotary_pct=0.25)
    return _finish(GPTNeoXForCausalLM, cfg, attn_impl, seed)


def make_granite(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import GraniteConfig, GraniteForCausalLM
    # attention_multiplier replaces 1/sqrt(head_dim) as the attention scale (and the embedding, residual and logit
    # multipliers are Granite's own)
    cfg = GraniteConfig(**_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5,
                        logits_scaling=2.0)
    return _finish(GraniteForCausalLM, cfg, attn_impl, seed)


def make_olmo2(attn_impl: str = "sdpa", seed: int = 0):
    from transformers import Olmo2Config, Olmo2ForCausalLM
    # hidden 64 / 8 heads = head_dim 8 (scale 8**-0.5); q/k RMSNorm over the whole projection, post-norms
    cfg = Olmo2Config(**_COMMON, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
    return _finish(Olmo2ForCausalLM, cfg, attn_impl, seed)


ARCHS = {
    "llama": make_llama,
    "qwen2_gqa7": make_qwen2_gqa7,
    "qwen3": make_qwen3,
    "mistral": make_mistral,
    "mistral_swa": make_mistral_swa,
    "gemma3": make_gemma3,
    "phi3": make_phi3,
    "phi3_d96": make_phi3_d96,
    "phi_d80": make_phi_d80,
    "gpt_neox": make_gpt_neox,
    "granite": make_granite,
    "olmo2": make_olmo2,
}


def make(arch: str, attn_impl: str = "sdpa", seed: int = 0):
    """Build the tiny model `arch` (a key of ARCHS) with attn_implementation `attn_impl` ("sdpa" or "eager")."""
    try:
        factory = ARCHS[arch]
    except KeyError:
        raise KeyError(f"unknown arch {arch!r}; known: {sorted(ARCHS)}") from None
    return factory(attn_impl, seed)


def make_batch(lengths=(12, 7), vocab_size: int = VOCAB, seed: int = 0, pad_token_id: int = PAD_ID,
               bos_token_id: int = BOS_ID):
    """A left-padded batch: (input_ids [B, max(lengths)] int64, attention_mask [B, max(lengths)] int64).

    Row i holds BOS + lengths[i]-1 random tokens in [3, vocab) at its right end, PAD on its left; the mask is 1 on
    real tokens. Default: 2 prompts of lengths 12 and 7 (5 pad slots in row 1).
    """
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError("every prompt needs at least one token")
        toks = torch.randint(3, vocab_size, (n,), generator=g)
        toks[0] = bos_token_id
        input_ids[i, width - n:] = toks
        attention_mask[i, width - n:] = 1
    return input_ids, attention_mask
