"""RoPE scaling (utils/rope_config.py, model/rope_scaling.py): linear, dynamic, Llama 3.1's and YaRN's frequencies
equal transformers' bit for bit; Llama 3.x / YaRN checkpoints import and export with transformers' logits; the fused
kernels and the KV cache under YaRN's scaled cos / sin; every bad setting is one ValueError naming the field."""
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, hf_config_dict, import_hf
from model.rotary import RotaryEmbedding
from utils.rope_config import normalize_rope_scaling, rope_scaling_from_hf

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

# head_dim 16 at theta 10000: wavelengths 6.3 .. 2e4 positions, so Llama 3's three bands (kept below 64 / 4 = 16,
# ramped between, divided above 64) and YaRN's ramp (dimensions 0..3 at original length 64) each hold frequencies
SETTINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_deepseek": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                      "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "truncate": False, "attention_factor": 1.25},
    "yarn_implicit_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},  # 256/64
}


def _hf_config(setting: dict, **kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256, initializer_range=0.1)
    return LlamaConfig(**{**base, **kw}, rope_scaling=dict(setting))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_cos_and_sin_equal_transformers_bit_for_bit(name):
    hf_cfg = _hf_config(SETTINGS[name])
    ours_cfg = config_from_hf(hf_cfg.to_dict())
    assert ours_cfg.rope_scaling["type"] == SETTINGS[name]["rope_type"]
    hf, ours = LlamaRotaryEmbedding(hf_cfg), RotaryEmbedding(ours_cfg)
    assert torch.equal(ours.inv_freq, hf.inv_freq)  # (before a long batch: transformers' dynamic keeps its own)
    # positions past the pretraining length and past max_seq_len (dynamic NTK's base grows there)
    for length in (40, 300):
        positions = torch.arange(length)[None]
        cos, sin = hf(torch.zeros(1, length, 64), positions)
        got_cos, got_sin = ours(positions)
        half = ours_cfg.head_dim // 2
        assert torch.equal(got_cos[0, :, 0], cos[0, :, :half]) and torch.equal(got_sin[0, :, 0], sin[0, :, :half])
    assert ours.attention_factor == hf.attention_scaling
    if name != "dynamic":  # the table the forward reads equals the per-call computation
        table = ours.table(0, 200)
        assert torch.equal(table[0], ours(torch.arange(200)[None])[0])


def test_llama3_keeps_high_frequencies_and_divides_low_ones():
    """The bands themselves, against the plain frequencies (so the test above compares something that moved)."""
    cfg = config_from_hf(_hf_config(SETTINGS["llama3"]).to_dict())
    plain = RotaryEmbedding(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None})).inv_freq
    got = RotaryEmbedding(cfg).inv_freq
    wavelength = 2 * torch.pi / plain
    high, low = wavelength < 16, wavelength > 64
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(got[high], plain[high]) and torch.allclose(got[low], plain[low] / 8)
    middle = ~high & ~low
    assert ((got[middle] < plain[middle]) & (got[middle] > plain[middle] / 8)).all()


@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn_deepseek"])
def test_checkpoint_imports_and_exports_with_transformers_logits(tmp_path, name):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(_hf_config(SETTINGS[name])).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 128, (2, 100))  # past the pretraining length of 64
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    assert config_from_hf(back.config.to_dict()).rope_scaling == ours.cfg.rope_scaling
    # 4.x readers find the same settings under rope_scaling
    legacy = hf_config_dict(ours.cfg)
    assert rope_scaling_from_hf({**legacy, "rope_parameters": None}) == ours.cfg.rope_scaling


def test_a_llama_31_config_json_reads_as_meta_wrote_it():
    """config.json as the Hub's Llama-3.1 / 3.2 checkpoints hold it (4.x spelling, rope_scaling beside rope_theta)."""
    d = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    cfg = config_from_hf(d)
    assert cfg.rope_theta == 500000.0 and cfg.max_seq_len == 131072 and cfg.tie_embeddings
    assert cfg.rope_scaling == {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def _tiny(scaling: dict, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, multiple_of=16,
                       rope_scaling=normalize_rope_scaling(scaling, 32), **kw)


def _loss_and_grads(model, x, y, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(x, labels=y, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_rope_kernels_follow_the_reference_under_yarns_scaled_cos_and_sin(backend):
    """cos / sin of norm attention_factor (1.14 here), not 1: the fused forward and its backward (a rotation by
    -theta with the same cos / sin) against the reference rotation, packed positions included."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU Triton needs TRITON_INTERPRET=1 before triton is imported")
    torch.manual_seed(0)
    ref = Transformer(_tiny(YARN, fused_rope=False, fused_rmsnorm=False, fused_swiglu=False, fused_qkv=False,
                            fused_cross_entropy=False)).double()
    assert RotaryEmbedding(ref.cfg).attention_factor > 1.1
    fused = Transformer(_tiny(YARN, fused_rope=True, kernel_backend=backend))
    fused.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (2, 24), generator=g), torch.randint(0, 97, (2, 24), generator=g)
    packed = torch.tensor([list(range(10)) + list(range(14)), list(range(24))])
    for kw in ({}, {"position_ids": packed}):
        truth, got = _loss_and_grads(ref, x, y, **kw), _loss_and_grads(fused, x, y, **kw)
        eager32 = Transformer(_tiny(YARN, fused_rope=False))
        eager32.load_state_dict(fused.state_dict())
        plain = _loss_and_grads(eager32, x, y, **kw)
        for name in truth[1]:  # the fused error within 4x the unfused fp32 error (+ fp32 ulps of the scale)
            t = truth[1][name].float()
            bound = 4 * (plain[1][name] - t).abs().max() + 16 * torch.finfo(torch.float32).eps * t.abs().max()
            assert (got[1][name] - t).abs().max() <= bound, name
        assert abs(float(got[0]) - float(truth[0])) <= 4 * abs(float(plain[0]) - float(truth[0])) + 1e-6


@pytest.mark.parametrize("scaling", [YARN, {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}])
def test_kv_cache_decoding_equals_the_whole_sequence(scaling):
    from model.generate import generate
    torch.manual_seed(0)
    model = Transformer(_tiny(scaling)).eval()
    prompt = torch.randint(0, 97, (1, 6))
    cached = generate(model, prompt, max_new_tokens=20, temperature=0.0, use_cache=True)
    whole = generate(model, prompt, max_new_tokens=20, temperature=0.0, use_cache=False)
    assert torch.equal(cached, whole)


@pytest.mark.parametrize("setting,phrase", [
    ({"type": "mrope", "factor": 2.0}, "rope_scaling type must be one of linear, dynamic, llama3, yarn, longrope"),
    ({"type": "longrope", "factor": 2.0}, "rope_scaling longrope: missing short_factor, long_factor"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_scaling llama3: missing high_freq_factor"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "must be above"),
    ({"type": "linear", "factor": 0.5}, "rope_scaling linear: factor must be a finite number >= 1"),
    ({"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "rope_scaling linear: unknown field(s) low_freq"),
    ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8.5}, "must be an integer >= 1"),
    ({"type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 32}, "beta_fast (1) must be >= beta_slow (32)"),
    ({"type": "yarn", "factor": 2.0, "truncate": "no"}, "truncate must be true or false"),
    ({"type": "dynamic", "factor": float("nan")}, "factor must be a finite number"),
    ("yarn", "must be a dict"),
])
def test_a_bad_setting_is_one_error_naming_the_field(setting, phrase):
    with pytest.raises(ValueError) as e:
        _tiny(setting)
    assert phrase in str(e.value)


def test_canonical_settings_are_complete_and_read_back_unchanged():
    got = normalize_rope_scaling({"rope_type": "yarn", "factor": 4}, 32)
    assert got == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                   "beta_slow": 1.0, "attention_factor": pytest.approx(1 + 0.1 * torch.log(torch.tensor(4.0)).item()),
                   "truncate": True}
    cfg = _tiny(got)
    assert cfg.rope_scaling == got and ModelConfig.from_json(cfg.to_json()) == cfg
    assert normalize_rope_scaling({"type": "default"}, 32) is None
    assert normalize_rope_scaling({"type": "yarn", "factor": 2, "original_max_position_embeddings": 16.0}, 32) == \
        normalize_rope_scaling({"type": "yarn", "factor": 2, "original_max_position_embeddings": 16}, 32)
    assert normalize_rope_scaling({"type": "linear", "factor": 2}, 32) == {"type": "linear", "factor": 2.0}
