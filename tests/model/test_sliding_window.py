"""Sliding-window attention (ModelConfig.sliding_window / sliding_layers, model/attention.py's rule): the masks of
every path against the rule written out by hand, a Mistral (v0.1's window) and a Qwen2 / Qwen3 whose last layers
slide imported with transformers' logits and exported back, the KV cache equal to the whole sequence past the window,
packed documents each seeing only itself, and the layouts that cannot hold a window refused."""
import pytest
import torch

from model import ModelConfig, Transformer
from model import attention as A
from model.hf_interop import config_from_hf, export_hf, import_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def test_the_rule_and_its_masks():
    """Key j is visible to query i iff i - window < j <= i (and in i's document): the dense mask with and without
    a KV cache, written out by hand."""
    T, w = 9, 3
    m = A.dense_mask(T, 0, torch.device("cpu"), window=w)[0, 0]
    hand = torch.tensor([[i - w < j <= i for j in range(T)] for i in range(T)])
    assert torch.equal(m, hand)
    past = 5  # 4 new queries over a cache of 5
    m = A.dense_mask(4, past, torch.device("cpu"), window=w)[0, 0]
    assert torch.equal(m, torch.tensor([[i - w < j <= i for j in range(past + 4)] for i in range(past, past + 4)]))
    docs = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2]])
    m = A.dense_mask(T, 0, torch.device("cpu"), docs=docs, window=w)[0, 0]
    assert torch.equal(m, hand & (docs[0][:, None] == docs[0][None, :]))
    spec = A.build_spec(1, 4, torch.arange(4)[None], window=w + 1)  # no longer than the window: no second spec
    assert spec.windowed is None
    spec = A.build_spec(1, T, torch.arange(T)[None], window=w)
    assert spec.kind == "sdpa" and spec.windowed.kind == "sdpa_masked" and torch.equal(spec.windowed.mask[0, 0], hand)


def _mistral(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=6)).eval()
    hf.save_pretrained(tmp_path / "mistral")
    return hf, str(tmp_path / "mistral")


def test_a_mistral_with_a_window_imports_with_its_logits_and_exports_as_a_mistral(tmp_path):
    from transformers import MistralForCausalLM

    from model.generate import generate
    hf, path = _mistral(tmp_path)
    ours = import_hf(path).eval()
    assert ours.cfg.sliding_window == 6 and ours.cfg.sliding_layers is None
    x = torch.randint(0, 128, (2, 20))  # longer than the window
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        full = import_hf(path, sliding_window=None).eval()  # the window matters past it
        assert torch.allclose(full(x)[:, :6], ref[:, :6], atol=1e-5) and not torch.allclose(full(x), ref, atol=1e-3)
        export_hf(ours, str(tmp_path / "out"))
        back = MistralForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.sliding_window == 6 and torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    prompt = x[:1, :4]  # decoding past the window: the cache's last 6 positions
    assert torch.equal(generate(ours, prompt, 14, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 14, temperature=0.0, use_cache=False))


def _through_ours_and_back(hf, tmp_path, T: int):
    """`hf` saved and imported, then our export loaded back by transformers (whichever class its config names): both
    give hf's logits on T positions (atol 1e-5). Returns (ours, back)."""
    from transformers import AutoModelForCausalLM
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 128, (2, T))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    return ours, back


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_whose_last_layers_slide(tmp_path, family):
    """use_sliding_window with max_window_layers=1: layers 1 and 2 slide, layer 0 sees everything."""
    import transformers as tf
    config_cls, model_cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    extra = {"head_dim": 32} if family == "qwen3" else {}
    hf = model_cls(config_cls(**SHAPE, **extra, use_sliding_window=True, sliding_window=5,
                              max_window_layers=1)).eval()
    ours, back = _through_ours_and_back(hf, tmp_path, 16)
    assert ours.cfg.sliding_window == 5 and ours.cfg.sliding_layers == [1, 2]
    assert type(back) is model_cls
    assert back.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


def test_packed_documents_slide_within_themselves():
    """Two documents packed in one row (position_ids restarting) give each document's logits alone."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=32,
                                    sliding_window=4)).eval()
    a, b = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 7))
    packed = torch.cat((a, b), dim=1)
    pos = torch.cat((torch.arange(9), torch.arange(7)))[None]
    with torch.no_grad():
        out = model(packed, position_ids=pos)
        assert torch.allclose(out[:, :9], model(a), atol=1e-5) and torch.allclose(out[:, 9:], model(b), atol=1e-5)


def test_what_cannot_hold_a_window_is_refused():
    from model.hf_interop import hf_config_dict
    for bad, why in ((dict(sliding_window=0), "sliding_window=0 must be an integer >= 1"),
                     (dict(sliding_window=4, sliding_layers=[0, 5]), r"sliding_layers=\[0, 5\] must list")):
        with pytest.raises(ValueError, match=why):
            ModelConfig(dim=32, n_heads=4, n_layers=3, **bad)
    with pytest.raises(ValueError, match="a Mistral / Mixtral slides in every layer"):
        hf_config_dict(ModelConfig(dim=32, n_heads=4, n_layers=3, sliding_window=4, sliding_layers=[1]))
    with pytest.raises(ValueError, match="slides in its last layers only"):
        hf_config_dict(ModelConfig(dim=32, n_heads=4, n_layers=3, sliding_window=4, sliding_layers=[0],
                                   qkv_bias=True))
    assert config_from_hf({**SHAPE, "model_type": "qwen2", "sliding_window": 4}).sliding_window is None  # off


def test_the_flag_builds_a_sliding_model_and_context_parallelism_is_refused():
    from trainer.config import TrainConfig, TrainingError
    from trainer.start import new_model_config
    from trainer.validation import validate_config
    cfg = TrainConfig(data_dir="d", tokenizer_dir="t", sliding_window=8)
    validate_config(cfg, torch_free=True)
    assert new_model_config(cfg, {"vocab_size": 64}).sliding_window == 8
    for bad, why in ((dict(sliding_window=-1), "--sliding_window=-1"),
                     (dict(sliding_window=8, context_parallel_size=2), "not in the ring attention")):
        with pytest.raises(TrainingError, match=why):
            validate_config(TrainConfig(data_dir="d", tokenizer_dir="t", **bad), world_size=2, torch_free=True)


@pytest.mark.parametrize("window", [None, 6])
def test_a_phi3_imports_as_the_llama_it_is(tmp_path, window):
    """Phi-3 / Phi-4 (Phi3ForCausalLM): a Llama whose q/k/v and gate/up weights are stored fused; Phi-3-mini's window
    too. Its logits through our model, exported back as a Llama (a Mistral with the window) with the same logits
    (Phi-4-mini's partial rotary and LongRoPE: tests/model/test_phi4_mini.py)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(Phi3Config(**SHAPE, sliding_window=window, pad_token_id=0)).eval()
    ours, back = _through_ours_and_back(hf, tmp_path, 20)
    assert ours.cfg.sliding_window == window
    assert type(back).__name__ == ("MistralForCausalLM" if window else "LlamaForCausalLM")

