"""Gemma 3's text model (Gemma3ForCausalLM): our block with Gemma's switches (scaled embeddings, the sublayers' output
norms, GeGLU, q / k norms, scores over sqrt(query_pre_attn_scalar), sliding layers rotating at their own base) and
its (1 + w) norm weights read as ours. A tiny Gemma3ForCausalLM imports with transformers' logits and gradients, decodes
past its window with the KV cache, and exports back as one; each switch moves the logits (none is decoration);
what our model lacks is refused by name."""
import dataclasses
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import (each_switch_moves_the_logits, gradients_equal_transformers,
                                          streamed_export_equals_whole)

transformers = pytest.importorskip("transformers")

VOCAB = 101
# 4 heads of 32 at hidden 64, 3 of 4 layers sliding over 6 positions at RoPE base 1000, the full one at 1e5 with
# linear scaling x2 (Gemma 3 4B+'s kind), scores over sqrt(24) (not sqrt(head_dim): Gemma 3 27B's kind)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=6,
             query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})


def _gemma3(tmp_path, tie: bool = True):
    """A tiny Gemma3ForCausalLM with norm weights away from 0 (transformers starts them at 0, i.e. a scale of 1:
    a released model's are not), saved."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "gemma3")
    return hf, str(tmp_path / "gemma3")


@pytest.mark.parametrize("fused", [True, False])
def test_a_gemma3_imports_with_transformers_logits_and_exports_as_a_gemma3(tmp_path, fused):
    from transformers import Gemma3ForCausalLM

    from model.generate import generate
    hf, path = _gemma3(tmp_path)
    ours = import_hf(path, fused_qkv=fused, fused_rmsnorm=fused, fused_rope=fused).eval()
    c = ours.cfg
    assert (c.sandwich_norms, c.scale_embeddings, c.mlp_act, c.qk_norm, c.query_scale) == (True, True, "gelu_tanh",
                                                                                          True, 24.0)
    assert (c.sliding_window, c.sliding_layers, c.rope_local_theta, c.rope_theta) == (6, [0, 1, 3], 1000.0, 1e5)
    assert c.rope_scaling == {"type": "linear", "factor": 2.0} and c.tie_embeddings
    # (1 + w): a norm's weight is Gemma's plus one
    hub_norm = hf.model.layers[1].pre_feedforward_layernorm.weight
    assert torch.equal(ours.layers[1].post_attention_layernorm.weight, hub_norm + 1)
    x = torch.randint(0, VOCAB, (2, 20))  # past the window
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        back = Gemma3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.model_type == "gemma3_text" and back.config.layer_types == SHAPE["layer_types"]
        assert back.config.query_pre_attn_scalar == 24 and back.config.rope_parameters == hf.config.rope_parameters
        assert torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {n for n in hf.state_dict() if n != "lm_head.weight"}
        # (1 + w) - 1 in fp32: w within half an fp32 ulp of 1
        back_norm = f.get_tensor("model.layers.1.pre_feedforward_layernorm.weight")
        assert torch.allclose(back_norm, hub_norm, atol=torch.finfo(torch.float32).eps / 2, rtol=0)
    prompt = x[:1, :5]
    assert torch.equal(generate(ours, prompt, 14, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 14, temperature=0.0, use_cache=False))


def test_each_of_gemmas_switches_moves_the_logits(tmp_path):
    """Turn each of the block's switches off in the imported model: the logits leave transformers' (a switch the
    forward ignored would leave them)."""
    hf, path = _gemma3(tmp_path)
    x = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        ref = hf(x).logits
    mutations = {
        "scale_embeddings": lambda m: setattr(m, "cfg", dataclasses.replace(m.cfg, scale_embeddings=False)),
        "sandwich_norms": lambda m: [setattr(b, "sandwich", False) for b in m.layers],
        "geglu": lambda m: [setattr(b.mlp, "act", "silu") for b in m.layers],
        "query_scale": lambda m: [setattr(b.self_attn, "q_scale", None) for b in m.layers],
        "rope_local_theta": lambda m: [setattr(b, "local_rope", False) for b in m.layers],
        "sliding_window": lambda m: [setattr(b.self_attn, "sliding", False) for b in m.layers],
    }
    each_switch_moves_the_logits(path, ref, x, mutations)


def test_gemma3_gradients_equal_transformers(tmp_path):
    """Through the sandwich norms, GeGLU, the scaled embedding and scores, against transformers' autograd on the same
    weights and batch (untied: the embedding's gradient alone); fp32 rounding of the two orders."""
    from model.hf_gemma3 import to_hub
    hf, path = _gemma3(tmp_path, tie=False)
    ours = import_hf(path)
    gradients_equal_transformers(hf, ours, to_hub, VOCAB)
    assert float(ours.layers[0].mlp_output_norm.weight.grad.abs().max()) > 0


def test_packed_documents_equal_each_alone(tmp_path):
    """position_ids restarting per document: the sliding layers' own RoPE table is computed for those positions."""
    _, path = _gemma3(tmp_path)
    ours = import_hf(path).eval()
    a, b = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (1, 11))
    pos = torch.cat((torch.arange(9), torch.arange(11)))[None]
    with torch.no_grad():
        packed = ours(torch.cat((a, b), 1), position_ids=pos)
        assert torch.allclose(packed[:, :9], ours(a), atol=1e-5, rtol=0)
        assert torch.allclose(packed[:, 9:], ours(b), atol=1e-5, rtol=0)


def test_transformers_4_configs_and_refusals():
    """A Hub config.json as Gemma 3 1B's (transformers 4.50: rope_theta, rope_local_base_freq, sliding_window_pattern,
    no layer_types, no tie_word_embeddings) reads with transformers' defaults; what our model lacks is named."""
    hub = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
           "max_position_embeddings": 32768, "query_pre_attn_scalar": 32, "rope_local_base_freq": 10000,
           "rope_theta": 1000000, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
           "rms_norm_eps": 1e-6, "final_logit_softcapping": None, "attn_logit_softcapping": None}
    c = config_from_hf(hub)
    assert c.tie_embeddings and c.query_scale is None and c.norm_eps == 1e-6  # (query_pre_attn_scalar = head_dim)
    assert c.sliding_layers == [0, 1, 2, 3, 4, 6, 7] and c.sliding_window == 512
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    out = hf_config_dict(c)
    assert out["layer_types"][5] == "full_attention" and out["query_pre_attn_scalar"] == 32
    assert out["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (c.attn_softcap, c.final_softcap) == (None, None)
    capped = config_from_hf({**hub, "final_logit_softcapping": 30, "attn_logit_softcapping": 50})
    assert (capped.attn_softcap, capped.final_softcap) == (50.0, 30.0)  # (read as Gemma 2's: model/hf_gemma2.py)
    assert hf_config_dict(capped)["final_logit_softcapping"] == 30.0
    for bad, why in ((dict(use_bidirectional_attention=True), "bidirectional"),
                     (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
                     (dict(model_type="recurrent_gemma"), "RecurrentGemma's recurrent blocks")):
        with pytest.raises(ValueError, match=why):
            config_from_hf({**hub, **bad})


def test_mixed_fields_are_refused_and_counts_follow():
    from model.flops import matmul_params
    from utils.model_bounds import param_count
    base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)
    cfg = ModelConfig(**base, sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh", qk_norm=True)
    model = Transformer(cfg)
    assert param_count(32, 2, 4, 96, 2, multiple_of=16, qk_norm=True, sandwich_norms=True) == model.num_params()
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    assert matmul_params(cfg) == weights
    with pytest.raises(ValueError, match="does not fit: scale_embeddings off"):
        hf_config_dict(dataclasses.replace(cfg, scale_embeddings=False))
    with pytest.raises(ValueError, match="no transformers family"):
        hf_config_dict(ModelConfig(**base, mlp_act="gelu_tanh"))
    for bad, why in ((dict(mlp_act="relu"), "mlp_act must be silu or gelu_tanh"),
                     (dict(mlp_act="gelu_tanh", moe_num_experts=4), "experts are SwiGLU"),
                     (dict(rope_local_theta=1e4), "needs sliding_window"),
                     (dict(query_scale=0), "query_scale=0 must be a number > 0"),
                     (dict(sandwich_norms=True, mtp_num_layers=1), "multi-token prediction")):
        with pytest.raises(ValueError, match=why):
            ModelConfig(**base, **bad)


def test_pipeline_parts_compose_to_the_model():
    """Pipeline stages (Transformer.pruned) carry the sliding layers' RoPE table: the parts give the whole model's."""
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=32,
                      qk_norm=True, attn_head_dim=16, sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh",
                      query_scale=12.0, sliding_window=5, sliding_layers=[0, 2], rope_local_theta=100.0)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    first = Transformer.pruned(model, [0, 1], embedding=True, head=False)
    last = Transformer.pruned(model, [2], embedding=False, head=True)
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(last(first(x)), model(x))


def test_a_streamed_export_writes_the_same_tensors(tmp_path):
    """export_hf_streaming (a sharded run's export, a few tensors at a time, here over several safetensors shards)
    renames and shifts Gemma's norms as the whole-model export does."""
    _, path = _gemma3(tmp_path, tie=False)
    streamed_export_equals_whole(import_hf(path), tmp_path, 40_000)


def _vision_language(tmp_path):
    """A tiny Gemma3ForConditionalGeneration (Gemma 3 4B-27B's class) over SHAPE's text model, saved."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    torch.manual_seed(0)
    cfg = Gemma3Config(text_config=dict(SHAPE, model_type="gemma3_text"), mm_tokens_per_image=4,
                       vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=14),
                       image_token_index=100, boi_token_index=98, eoi_token_index=99)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "language" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "vl")
    return hf, tmp_path / "vl"


def test_a_vision_language_checkpoint_gives_its_text_model(tmp_path):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration checkpoints: the text model is read (the vision tower left
    out) from transformers' saved layout (`language_model.model.`) and from 5.x's (`model.language_model.`,
    `lm_head`), with the vision-language model's logits on text; the export is a text-only Gemma3ForCausalLM."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForCausalLM
    hf, path = _vision_language(tmp_path)
    saved = load_file(str(path / "model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in saved)  # (what is left out)
    renamed = tmp_path / "vl5"
    renamed.mkdir()
    (renamed / "config.json").write_text((path / "config.json").read_text())
    moves = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."))
    for old, new in moves:
        saved = {(new + n[len(old):] if n.startswith(old) else n): t for n, t in saved.items()}
    save_file(saved, str(renamed / "model.safetensors"))
    x = torch.randint(0, 97, (2, 20))  # text only (no image token ids)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        for d in (path, renamed):
            ours = import_hf(str(d)).eval()
            assert ours.cfg.sliding_layers == [0, 1, 3] and ours.cfg.query_scale == 24.0
            assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0), d
        export_hf(ours, str(tmp_path / "text"))
        back = Gemma3ForCausalLM.from_pretrained(str(tmp_path / "text")).eval()
        assert torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)


def test_a_text_config_of_only_what_differs_takes_transformers_defaults():
    """Gemma 3 4B's config.json sets only what differs from Gemma3TextConfig's defaults in its text_config: ours reads
    what transformers' config object holds."""
    from transformers import Gemma3Config
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    theirs = Gemma3Config(text_config=text).text_config
    ours = config_from_hf({"model_type": "gemma3", "text_config": text, "vision_config": {}})
    assert (ours.vocab_size, ours.dim, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.head_dim, ours.hidden_dim) \
        == (theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
            theirs.num_key_value_heads, theirs.head_dim, theirs.intermediate_size)
    assert ours.sliding_layers == [i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention"]
    assert ours.sliding_window == theirs.sliding_window and ours.tie_embeddings == theirs.tie_word_embeddings
    rope = theirs.rope_parameters
    assert ours.rope_theta == rope["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    full = rope["full_attention"]
    assert ours.rope_scaling == {"type": full["rope_type"], "factor": full["factor"]}
    assert (ours.query_scale or ours.head_dim) == theirs.query_pre_attn_scalar
    assert (ours.norm_eps, ours.max_seq_len) == (theirs.rms_norm_eps, theirs.max_position_embeddings)
