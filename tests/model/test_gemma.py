"""Gemma 1 (GemmaForCausalLM: Gemma 2B / 7B, Gemma 1.1, CodeGemma): a Llama with the scaled embedding, GeGLU, heads
sized on their own and (1 + w) norm weights under a Llama's names. A tiny GemmaForCausalLM (one key/value head, as
Gemma 2B's; norm weights away from 0) imports with transformers' logits, loss and gradients, decodes through the KV
cache and the fast decoder, and exports back as one; the releases' legacy `hidden_act: "gelu"` reads as the tanh
form (as transformers reads it); what our model lacks is refused by name."""
import copy
import dataclasses

import pytest
import torch

from model.hf_interop import config_from_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import (cache_steps_equal_whole, fp64_logits_both_ways, gradients_equal_transformers,
                                          saved_hf)

transformers = pytest.importorskip("transformers")

VOCAB = 89
SHAPE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _gemma(tmp_path, tie: bool = True):
    from transformers import GemmaConfig, GemmaForCausalLM
    return saved_hf(GemmaForCausalLM, GemmaConfig(**SHAPE, tie_word_embeddings=tie), tmp_path, "gemma",
                    lambda name, p: p.normal_(0.0, 0.3) if "norm" in name else None)


def test_a_gemma_imports_with_transformers_logits_and_exports_as_a_gemma(tmp_path):
    from transformers import GemmaForCausalLM
    hf, path = _gemma(tmp_path)
    ours = import_hf(path).eval()
    c = ours.cfg
    assert (c.scale_embeddings, c.mlp_act, c.sandwich_norms, c.qk_norm, c.attn_head_dim, c.n_kv_heads) == (
        True, "gelu_tanh", False, False, 16, 1)
    hub_norm = hf.model.layers[1].post_attention_layernorm.weight  # (a Llama's name: the MLP's input norm)
    assert torch.equal(ours.layers[1].post_attention_layernorm.weight, hub_norm + 1)
    x = torch.randint(0, VOCAB, (2, 12))
    d = fp64_logits_both_ways(hf, ours, GemmaForCausalLM.from_pretrained, tmp_path, x)
    assert d["architectures"] == ["GemmaForCausalLM"] and d["hidden_act"] == "gelu_pytorch_tanh"
    assert config_from_hf(d) == c
    cache_steps_equal_whole(copy.deepcopy(ours).double(), x, prefill=5)  # (greedy: the fast decoder)


def test_gemma_loss_and_gradients_equal_transformers(tmp_path):
    from model.hf_gemma3 import to_hub
    hf, path = _gemma(tmp_path, tie=False)
    ours = import_hf(path)
    gradients_equal_transformers(hf, ours, lambda sd: to_hub(sd, rename=False), VOCAB)


def test_the_legacy_activation_reads_and_what_gemma_cannot_hold_is_refused():
    hub = {**SHAPE, "model_type": "gemma", "hidden_act": "gelu", "hidden_activation": None}
    c = config_from_hf(hub)  # (Gemma 1's releases: "gelu", meant as the tanh approximation)
    assert c.mlp_act == "gelu_tanh" and c.tie_embeddings
    with pytest.raises(ValueError, match="hidden_activation='relu'"):
        config_from_hf({**hub, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="written as Gemma 1, which it does not fit: q / k norms"):
        hf_config_dict(dataclasses.replace(c, qk_norm=True))
    with pytest.raises(ValueError, match="a sliding window"):
        hf_config_dict(dataclasses.replace(c, sliding_window=8))
