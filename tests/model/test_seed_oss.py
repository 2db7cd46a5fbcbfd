"""ByteDance Seed-OSS (SeedOssForCausalLM): a Llama with q/k/v biases (and optionally an o_proj bias), heads sized on
their own, dropout on the attention probabilities and on each sublayer's output. A tiny SeedOssForCausalLM with both
kinds of bias imports with transformers' logits, loss and gradients, decodes through the KV cache, and exports back
as one; its dropout rates are read; what it cannot hold is refused by name."""
import copy
import dataclasses

import pytest
import torch

from model.hf_interop import config_from_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import (cache_steps_equal_whole, fp64_logits_both_ways, gradients_equal_transformers,
                                          saved_hf)

transformers = pytest.importorskip("transformers")

VOCAB = 79
SHAPE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attention_bias=True,
             attention_out_bias=True, attention_dropout=0.0, residual_dropout=0.0,
             pad_token_id=None,  # (transformers' 1 gives its embedding padding_idx 1: no gradient for that row)
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _seed_oss(tmp_path, tie: bool = False):
    from transformers import SeedOssConfig, SeedOssForCausalLM
    return saved_hf(SeedOssForCausalLM, SeedOssConfig(**SHAPE, tie_word_embeddings=tie), tmp_path, "seed_oss",
                    lambda name, p: p.normal_(0.0, 0.5) if name.endswith("bias") else None)


def test_a_seed_oss_imports_with_transformers_logits_and_exports_as_one(tmp_path):
    from transformers import SeedOssForCausalLM
    hf, path = _seed_oss(tmp_path)
    ours = import_hf(path).eval()
    c = ours.cfg
    assert (c.qkv_bias, c.o_bias, c.attn_head_dim, c.attn_dropout, c.resid_dropout) == (True, True, 16, 0.0, 0.0)
    x = torch.randint(0, VOCAB, (2, 12))
    d = fp64_logits_both_ways(hf, ours, SeedOssForCausalLM.from_pretrained, tmp_path, x)
    assert d["architectures"] == ["SeedOssForCausalLM"] and config_from_hf(d) == c
    cache_steps_equal_whole(copy.deepcopy(ours).double(), x, prefill=5)


def test_seed_oss_loss_and_gradients_equal_transformers(tmp_path):
    hf, path = _seed_oss(tmp_path)
    gradients_equal_transformers(hf, import_hf(path), lambda sd: sd, VOCAB)


def test_its_dropout_defaults_read_and_what_it_cannot_hold_is_refused():
    hub = {k: v for k, v in SHAPE.items() if not k.endswith("dropout")}
    c = config_from_hf({**hub, "model_type": "seed_oss"})
    assert (c.attn_dropout, c.resid_dropout) == (0.1, 0.1)  # (transformers' SeedOssConfig defaults)
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf({**hub, "model_type": "seed_oss", "mlp_bias": True})
    with pytest.raises(ValueError, match="written as Seed-OSS, which it does not fit: a sliding window"):
        hf_config_dict(dataclasses.replace(c, sliding_window=8))
