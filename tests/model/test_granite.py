"""IBM Granite (GraniteForCausalLM): a Llama with four multipliers (the embedding's, each sublayer output's before the
residual add, the attention scores', and the logits' divisor). A tiny GraniteForCausalLM with each multiplier away
from 1 imports with transformers' logits, loss and gradients, decodes through the KV cache and the fast decoder, and
exports back as one; each multiplier moves the logits; what Granite cannot hold is refused by name."""
import copy
import dataclasses

import pytest
import torch

from model.hf_interop import config_from_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import (cache_steps_equal_whole, each_switch_moves_the_logits, fp64_logits_both_ways,
                                          gradients_equal_transformers, saved_hf)

transformers = pytest.importorskip("transformers")

VOCAB = 83
# Granite 3's kinds of values at toy scale: scores x 1/64 (not 1/sqrt(16)), the embedding x 12, the sublayers x 0.22,
# the logits / 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
             attention_multiplier=1 / 64, logits_scaling=8.0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _granite(tmp_path, tie: bool = True):
    from transformers import GraniteConfig, GraniteForCausalLM
    return saved_hf(GraniteForCausalLM, GraniteConfig(**SHAPE, tie_word_embeddings=tie), tmp_path, "granite",
                    lambda name, p: p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.1))


def test_a_granite_imports_with_transformers_logits_and_exports_as_a_granite(tmp_path):
    from transformers import GraniteForCausalLM
    hf, path = _granite(tmp_path)
    ours = import_hf(path).eval()
    c = ours.cfg
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling, c.query_scale) == (12.0, 0.22, 8.0,
                                                                                                64.0 ** 2)
    x = torch.randint(0, VOCAB, (2, 12))
    d = fp64_logits_both_ways(hf, ours, GraniteForCausalLM.from_pretrained, tmp_path, x)
    assert d["attention_multiplier"] == pytest.approx(1 / 64, rel=1e-12)
    assert d["architectures"] == ["GraniteForCausalLM"] and config_from_hf(d) == c
    from model.decode import fast_path_applies
    assert fast_path_applies(ours)
    cache_steps_equal_whole(copy.deepcopy(ours).double(), x, prefill=5)  # (greedy: the fast decoder)


def test_each_multiplier_moves_the_logits(tmp_path):
    hf, path = _granite(tmp_path)
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref = hf(x).logits
    off = {name: (lambda m, n=name: setattr(m, "cfg", dataclasses.replace(m.cfg, **{n: None})))
           for name in ("embedding_multiplier", "logits_scaling")}
    off["residual_multiplier"] = lambda m: [setattr(b, "residual_scale", None) for b in m.layers]
    off["attention_multiplier"] = lambda m: [setattr(b.self_attn, "q_scale", None) for b in m.layers]
    each_switch_moves_the_logits(path, ref, x, off)


def test_granite_loss_and_gradients_equal_transformers(tmp_path):
    hf, path = _granite(tmp_path, tie=False)
    gradients_equal_transformers(hf, import_hf(path), lambda sd: sd, VOCAB)


def test_what_granite_cannot_hold_is_refused():
    c = config_from_hf({**SHAPE, "model_type": "granite"})
    with pytest.raises(ValueError, match="written as Granite, which it does not fit: q / k norms"):
        hf_config_dict(dataclasses.replace(c, qk_norm=True))
    with pytest.raises(ValueError, match="attention_multiplier=0.0 must be > 0"):
        config_from_hf({**SHAPE, "model_type": "granite", "attention_multiplier": 0.0})
    with pytest.raises(ValueError, match="logits_scaling=-1.0 must be a number > 0"):
        dataclasses.replace(c, logits_scaling=-1.0)
    from model import Transformer
    from model.score_head import add_score_head
    rm = add_score_head(Transformer(dataclasses.replace(c, vocab_size=VOCAB)))  # (a reward model: no logits divisor)
    assert rm.cfg.logits_scaling is None and rm.cfg.embedding_multiplier == 12.0
    with pytest.raises(ValueError, match="no sequence-classification class for GraniteForCausalLM"):
        hf_config_dict(rm.cfg)
