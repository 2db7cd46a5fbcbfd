"""Model: config round trip, shapes, masks (padding, packing), GQA, checkpointing, dropout, reductions."""
import json

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.loss import cross_entropy_from_logits


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                hidden_dim=96, loss_chunk_size=7)
    base.update(kw)
    return ModelConfig(**base)


def test_config_json_round_trip_and_validation():
    cfg = tiny(rope_scaling={"type": "dynamic", "factor": 2}, tie_embeddings=True)
    back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.rope_scaling == {"type": "dynamic", "factor": 2.0}
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig(dim=4096, n_heads=32).hidden_dim == 11008  # Llama2-7B's width
    with pytest.raises(ValueError):
        ModelConfig.from_dict({**cfg.to_dict(), "dimm": 3})
    with pytest.raises(ValueError):
        tiny(n_kv_heads=3)
    with pytest.raises(ValueError):
        tiny(rope_scaling={"type": "longrope", "factor": 2})


def test_param_names_hf_style_and_independent_of_kernels():
    a = Transformer(tiny())
    b = Transformer(tiny(fused_rmsnorm=False, fused_rope=False, fused_swiglu=False, fused_qkv=False,
                         fused_cross_entropy=False, flash_attn=False))
    assert list(a.state_dict()) == list(b.state_dict())
    names = set(a.state_dict())
    assert {"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
            "norm.weight", "lm_head.weight"} <= names
    assert not any("mask" in n or "inv_freq" in n for n in names)  # trap 12: no mask buffer
    assert a.state_dict()["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # GQA


def test_fused_and_reference_paths_agree_forward_and_backward():
    torch.manual_seed(0)
    fast = Transformer(tiny())
    ref = Transformer(tiny(fused_rmsnorm=False, fused_rope=False, fused_swiglu=False, fused_qkv=False,
                           fused_cross_entropy=False))
    ref.load_state_dict(fast.state_dict())
    x = torch.randint(0, 128, (2, 20))
    y = torch.randint(0, 128, (2, 20))
    y[:, :5] = -100
    assert torch.allclose(fast(x), ref(x), atol=1e-5)
    lf, lr = fast(x, labels=y), ref(x, labels=y)
    assert torch.allclose(lf, lr, atol=1e-5)
    lf.backward()
    lr.backward()
    for (n, p), q in zip(fast.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


def test_loss_reductions_match_logits():
    torch.manual_seed(0)
    m = Transformer(tiny())
    x = torch.randint(0, 128, (2, 16))
    y = torch.randint(0, 128, (2, 16))
    y[0, :4] = -100
    logits = m(x)
    assert logits.shape == (2, 16, 128)
    for red in ("mean", "sum", "none"):
        assert torch.allclose(m(x, labels=y, reduction=red), cross_entropy_from_logits(logits, y, red), atol=1e-5)
    per_tok = m(x, labels=y, reduction="none")
    assert per_tok.shape == (2, 16) and (per_tok[0, :4] == 0).all()
    assert torch.allclose(per_tok.sum() / (y != -100).sum(), m(x, labels=y))


def test_padding_mask_matches_unpadded_rows():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    x = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding on row 1
    out = m(x, attention_mask=mask)
    assert torch.allclose(out[1, :8], m(x[1:, :8])[0], atol=1e-5)
    assert torch.allclose(out[0], m(x[:1])[0], atol=1e-5)
    # all-padded rows never produce NaN, and neither do their gradients
    y = x.clone()
    y[1, 8:] = -100
    m.train()
    loss = m(x, labels=y, attention_mask=mask)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_padding_mask_is_chosen_without_reading_its_values():
    """A batch with an attention_mask takes the masked path whatever its padding side: the old
    unmasked shortcut for right padding read the mask's values on the host (a device sync and a
    graph break every step). A mask of the wrong length is still an error."""
    torch.manual_seed(0)
    m = Transformer(tiny())
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 3:] = 0
    pos = torch.arange(12)[None].expand(3, 12)
    assert m._attn_spec(3, 12, pos, mask, False, None).mask is not None
    assert m._attn_spec(3, 12, pos, mask.flip(1), False, None).mask is not None
    with pytest.raises(ValueError):
        m._attn_spec(3, 12, pos, mask[:, :11], False, None)


def test_packed_position_ids_equal_separate_samples():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    a, b = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 9))
    packed = torch.cat((a, b), 1)
    pos = torch.cat((torch.arange(7), torch.arange(9)))[None]
    out = m(packed, position_ids=pos)
    assert torch.allclose(out[:, :7], m(a), atol=1e-5)
    assert torch.allclose(out[:, 7:], m(b), atol=1e-5)
    # plain arange position_ids take the is_causal path and equal the default
    assert torch.allclose(m(packed, position_ids=torch.arange(16)[None]), m(packed), atol=1e-6)


def test_gradient_checkpointing_same_gradients():
    torch.manual_seed(0)
    a = Transformer(tiny(resid_dropout=0.1, attn_dropout=0.1))
    b = Transformer(tiny(resid_dropout=0.1, attn_dropout=0.1, gradient_checkpointing=True))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 128, (2, 16))
    torch.manual_seed(1)
    la = a(x, labels=x)
    la.backward()
    torch.manual_seed(1)
    lb = b(x, labels=x)
    lb.backward()
    assert torch.allclose(la, lb)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n


def test_dropout_active_only_in_training_and_tied_embeddings():
    torch.manual_seed(0)
    m = Transformer(tiny(resid_dropout=0.5, tie_embeddings=True))
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.num_params() == sum(p.numel() for p in set(m.parameters()))
    x = torch.randint(0, 128, (1, 8))
    m.train()
    assert not torch.allclose(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))


def test_bf16_autocast_loss_close_to_fp32():
    torch.manual_seed(0)
    m = Transformer(tiny())
    x = torch.randint(0, 128, (2, 16))
    l32 = m(x, labels=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l16 = m(x, labels=x)
    assert l16.dtype == torch.float32 and abs(l16.item() - l32.item()) < 2e-2
    l16.backward()
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())


def _fake_flash():
    """Stand-ins with flash-attn's signatures and [B, T, H, D] / [N, H, D] layouts, built on SDPA."""
    def expand(k, h):
        return k.repeat_interleave(h // k.shape[-2], dim=-2)

    def func(q, k, v, dropout_p=0.0, causal=True):
        q, k, v = q.transpose(1, 2).float(), expand(k, q.shape[2]).transpose(1, 2).float(), expand(v, q.shape[2]).transpose(1, 2).float()
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=True):
        outs = []
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            outs.append(func(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal)[0])
        return torch.cat(outs)
    return func, varlen


def test_flash_attn_plumbing_with_stand_ins(monkeypatch):
    import model.kernels as K
    torch.manual_seed(0)
    ref = Transformer(tiny(flash_attn=False)).eval()
    fl = Transformer(tiny()).eval()
    fl.load_state_dict(ref.state_dict())
    calls = []
    func, varlen = _fake_flash()
    monkeypatch.setattr(K, "flash_attn_functions", lambda device: (
        lambda *a, **k: calls.append("dense") or func(*a, **k),
        lambda *a, **k: calls.append("varlen") or varlen(*a, **k)))
    x = torch.randint(0, 128, (2, 16))
    pos = torch.cat((torch.arange(5), torch.arange(11)))[None].expand(2, 16)
    # varlen needs the collate's cu_seqlens / max_seqlen: deriving them from position_ids would be a host sync
    cu = torch.tensor([0, 5, 16, 21, 32], dtype=torch.int32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.allclose(fl(x).float(), ref(x).float(), atol=2e-2)
        assert torch.allclose(fl(x, position_ids=pos, cu_seqlens=cu, max_seqlen=11).float(),
                              ref(x, position_ids=pos).float(), atol=2e-2)
    assert calls == ["dense"] * 2 + ["varlen"] * 2  # 2 layers each
