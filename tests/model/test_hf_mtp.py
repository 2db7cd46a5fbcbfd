"""Multi-token prediction layers in the Hub layout of DeepSeek-V3 and GLM-4.5 (model/hf_mtp.py through
model/hf_interop.py): our MTP depths are written as layers num_hidden_layers + k with their enorm / hnorm / eh_proj /
shared_head names and the copies of the embedding and head, read back as the very tensors when asked for, left out
otherwise; and each depth computes what transformers' modules compute with those tensors (its decoder layer, loaded
by transformers from the same directory, and the MTP formula as transformers' MtpLayer runs it: the main model's
final normed hidden state in, the depth's own norm out), which the old convention (the hidden state before the final
norm) does not."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from model.hf_interop import export_hf, import_hf
from model.hf_mtp import held_in_dir
from tests.model import test_hf_glm4_moe as glm
from tests.model import test_mla as mla
from utils.constants import IGNORE_INDEX

V = 96


def _sharpened(m):
    """Routers sharp enough (and biases that move the choice) in the depths' blocks too; every norm weight away from
    1, so that which hidden state is normed where shows in the numbers."""
    torch.manual_seed(3)
    with torch.no_grad():
        for block in [*m.layers, *(d.block for d in m.mtp.depths)]:
            if hasattr(block.mlp, "router"):
                torch.nn.init.normal_(block.mlp.router.weight, std=0.3)
                block.mlp.expert_bias.copy_(torch.randn(m.cfg.moe_num_experts) * 0.2)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m


MODELS = {"glm": lambda: glm._model(n_layers=2, mtp_num_layers=2),
          "deepseek": lambda: mla._model(**mla.MOE, n_layers=2, mtp_num_layers=1)}
HF_CLASS = {"glm": "Glm4MoeForCausalLM", "deepseek": "DeepseekV3ForCausalLM"}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_losses(out, kind, x, y, pre_norm=False):
    """(main loss, [depth k's summed loss]) from transformers: the main model of the export; each depth's decoder
    layer is layer L + k of the same directory loaded with num_hidden_layers = L + D (its own MoE, attention and
    norms, as transformers reads them); the MTP formula around it written out in float64 from the file's tensors."""
    import transformers
    cls = getattr(transformers, HF_CLASS[kind])
    raw = json.loads((out / "config.json").read_text())
    L, D = raw["num_hidden_layers"], raw["num_nextn_predict_layers"]
    kw = dict(dtype=torch.float64, experts_implementation="eager", attn_implementation="sdpa")
    hf = cls.from_pretrained(str(out), **kw).eval()
    big_dir = out.parent / f"{out.name}_big"
    big_dir.mkdir(exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            (big_dir / f.name).write_bytes(f.read_bytes())
    (big_dir / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=L + D)))
    big = cls.from_pretrained(str(big_dir), **kw).eval()
    t = {k: v.double() for k, v in load_file(str(out / "model.safetensors")).items()}
    eps, E, W = raw["rms_norm_eps"], hf.model.embed_tokens.weight, hf.lm_head.weight
    with torch.no_grad():
        o = hf(x, output_hidden_states=True)
        main = F.cross_entropy(o.logits.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        h = o.hidden_states[-1]  # (transformers' last hidden state: after the final norm)
        if pre_norm:  # the old convention: the last layer's output before the final norm
            seen = {}
            hook = hf.model.norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("h", args[0]))
            hf(x)
            hook.remove()
            h = seen["h"]
        B, T = x.shape
        per_depth = []
        for k in range(1, D + 1):
            n, p = T - k, f"model.layers.{L + k - 1}."
            e, hk = _rms(E[x[:, k:k + n]], t[p + "enorm.weight"], eps), _rms(h[:, :n], t[p + "hnorm.weight"], eps)
            inp = torch.cat([e, hk], -1) @ t[p + "eh_proj.weight"].T
            pos = torch.arange(n)[None].expand(B, n)
            block = big.model.layers[L + k - 1]
            z = block(inp, attention_mask=None, position_ids=pos, position_embeddings=big.model.rotary_emb(inp, pos))
            h = _rms(z[0] if isinstance(z, tuple) else z, t[p + "shared_head.norm.weight"], eps)
            per_depth.append(F.cross_entropy((h @ W.T).reshape(-1, V), y[:, k:k + n].reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum"))
    return main, per_depth


@pytest.mark.parametrize("kind", ["glm", "deepseek"])
def test_depths_round_trip_as_the_hubs_mtp_layers_and_compute_what_transformers_does(tmp_path, kind):
    model = _sharpened(MODELS[kind]())
    L, D = model.cfg.n_layers, model.cfg.mtp_num_layers
    out = tmp_path / "hf"
    export_hf(model, str(out))
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [HF_CLASS[kind]] and raw["num_nextn_predict_layers"] == D
    names = set(load_file(str(out / "model.safetensors")))
    for k in range(D):
        p = f"model.layers.{L + k}."
        assert {p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                                "post_attention_layernorm.weight", "mlp.gate.e_score_correction_bias",
                                "mlp.experts.0.gate_proj.weight", "mlp.shared_experts.down_proj.weight")} <= names
    assert not any(".mtp." in n or "router" in n for n in names) and held_in_dir(str(out)) == D

    ours = model.float().state_dict()
    back = import_hf(str(out), mtp_layers=D).state_dict()
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    plain = import_hf(str(out)).state_dict()  # (as transformers: without them unless asked)
    assert plain.keys() == {k for k in ours if not k.startswith("mtp.")}
    assert all(torch.equal(plain[k], ours[k]) for k in plain)
    if D > 1:
        one = import_hf(str(out), mtp_layers=1).state_dict()
        assert {k for k in one if k.startswith("mtp.")} == {k for k in ours if k.startswith("mtp.depths.0.")}

    x = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(5))
    y = torch.roll(x, -1, 1)
    y[:, -1] = IGNORE_INDEX
    m64 = import_hf(str(out), dtype=torch.float64, mtp_layers=D).train()
    main = m64(x, labels=y, reduction="sum")
    _, stats = m64.mtp.take()
    ref_main, ref = _reference_losses(out, kind, x, y)
    # the loss head keeps fp32 statistics by design and transformers routes in fp32: the main loss's own error
    # against transformers' float64 loss, times 8, bounds each depth's
    tol = 8 * max(abs(float(main) / float(ref_main) - 1), torch.finfo(torch.float32).eps)
    for k in range(D):
        assert abs(float(stats[k, 0]) / float(ref[k]) - 1) <= tol, (k, float(stats[k, 0]), float(ref[k]), tol)
    _, old = _reference_losses(out, kind, x, y, pre_norm=True)
    assert abs(float(stats[0, 0]) / float(old[0]) - 1) > 100 * tol  # the hidden state before the final norm is not it


def test_copies_that_are_not_the_models_are_refused_and_stripped_layers_are_not_held(tmp_path):
    model = _sharpened(MODELS["glm"]())
    out = tmp_path / "hf"
    export_hf(model, str(out))
    path = str(out / "model.safetensors")
    t = load_file(path)
    t["model.layers.2.shared_head.head.weight"] = t["model.layers.2.shared_head.head.weight"] + 1e-3
    save_file(t, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.shared_head\.head\.weight is not the model's "
                                         r"lm_head\.weight"):
        import_hf(str(out), mtp_layers=1)
    assert not any(k.startswith("mtp.") for k in import_hf(str(out)).state_dict())  # left out: nothing read
    # a re-upload without the MTP tensors (its config still counting them): none held, none made up
    save_file({k: v for k, v in t.items() if not k.startswith(("model.layers.2.", "model.layers.3."))}, path,
              metadata={"format": "pt"})
    assert held_in_dir(str(out)) == 0
    assert import_hf(str(out), mtp_layers=2).cfg.mtp_num_layers == 0


def test_a_family_without_mtp_layers_leaves_the_depths_out_and_a_model_grows_new_ones():
    """A Llama-family model has no place for them (the export is the next-token model); `add_mtp_depths` keeps the
    depths a model has and adds new ones initialised as a new model's would be."""
    from model import ModelConfig, Transformer
    from model.hf_interop import to_hf_state_dict, writes_mtp
    cfg = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=32)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**cfg, mtp_num_layers=1))
    assert not writes_mtp(m.cfg) and not any("eh_proj" in k for k in to_hf_state_dict(m))
    kept = {k: v.clone() for k, v in m.state_dict().items()}
    assert m.add_mtp_depths(1) == 0 and m.add_mtp_depths(3) == 2
    assert m.cfg.mtp_num_layers == 3 and len(m.mtp.depths) == 3
    grown = m.state_dict()
    assert all(torch.equal(grown[k], v) for k, v in kept.items())  # the model's own, depth 0 included
    fresh = grown["mtp.depths.2.block.self_attn.q_proj.weight"]
    assert 0.5 * 0.02 < float(fresh.std()) < 2 * 0.02  # as a new model's (N(0, 0.02))
    assert not torch.equal(fresh, grown["mtp.depths.1.block.self_attn.q_proj.weight"])
    capped = Transformer(ModelConfig(**cfg, final_softcap=30.0))  # (Gemma 2's capped logits: no depths; the trainer
    with pytest.raises(ValueError, match="final_softcap"):  # turns this into one line, exit 2)
        capped.add_mtp_depths(1)
    assert not hasattr(capped, "mtp") and capped.cfg.mtp_num_layers == 0


def test_a_streamed_export_writes_the_same_mtp_layers(tmp_path):
    """export_hf_streaming (an FSDP run's shards, a group of tensors at a time; shards of ~8 KB here, so the
    embedding, the head and the depths land in different groups) writes every tensor the whole export writes."""
    from model.hf_interop import export_hf_streaming
    model = _sharpened(MODELS["glm"]())
    export_hf(model, str(tmp_path / "whole"))
    sd = model.state_dict()
    specs = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    _, shards = export_hf_streaming(model.cfg, specs, lambda names: {n: sd[n] for n in names}, str(tmp_path / "hf"),
                                    max_shard_bytes=8192)
    assert shards > 4
    streamed = {}
    for f in (tmp_path / "hf").glob("model-*.safetensors"):
        streamed.update(load_file(str(f)))
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_tied_embeddings_give_each_depth_the_embedding_as_its_head(tmp_path):
    model = _sharpened(glm._model(n_layers=2, mtp_num_layers=1, tie_embeddings=True, moe_top_k=1, moe_n_groups=1,
                                  moe_topk_groups=1))
    export_hf(model, str(tmp_path / "hf"))
    t = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "lm_head.weight" not in t
    assert torch.equal(t["model.layers.2.shared_head.head.weight"], t["model.embed_tokens.weight"])
    ours, back = model.state_dict(), import_hf(str(tmp_path / "hf"), mtp_layers=1).state_dict()
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_every_weight_layout_gives_its_tensor_names_without_loading(tmp_path):
    """model/hf_files.py: a single safetensors file, shards named by an index, a pytorch_model.bin: `tensor_names`
    lists what `read_tensors` reads; nothing there is one error naming the directory."""
    from model.hf_files import read_tensors, tensor_names
    t = {f"model.layers.{i}.w": torch.full((2,), float(i)) for i in range(3)}
    (tmp_path / "one").mkdir()
    save_file(t, str(tmp_path / "one" / "model.safetensors"))
    (tmp_path / "shards").mkdir()
    save_file({k: t[k] for k in list(t)[:2]}, str(tmp_path / "shards" / "a.safetensors"))
    save_file({k: t[k] for k in list(t)[2:]}, str(tmp_path / "shards" / "b.safetensors"))
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < 2 else "b.safetensors" for i, k in enumerate(t)}}))
    (tmp_path / "bin").mkdir()
    torch.save(t, str(tmp_path / "bin" / "pytorch_model.bin"))
    for d in ("one", "shards", "bin"):
        got = read_tensors(str(tmp_path / d))
        assert sorted(tensor_names(str(tmp_path / d))) == sorted(t) == sorted(got), d
        assert all(torch.equal(got[k], t[k]) for k in t)
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        tensor_names(str(tmp_path / "none"))
