"""Checks the Hugging Face family tests share (test_gemma3.py, test_olmo.py, test_phi4_mini.py, test_mla.py,
test_hf_gpt_oss.py, test_gemma.py, test_granite.py, test_seed_oss.py): a tiny transformers model saved, fp64 logits
both ways, a model's gradients against transformers' autograd, each block switch moving the logits, a
streamed export against the whole one, the KV cache's logits against the whole forward's, packed documents against
each alone, LoRA adapters loaded by PEFT on an export."""
from __future__ import annotations

import json
from typing import Callable

import torch

from model.hf_interop import export_hf, export_hf_streaming, import_hf


def saved_hf(model_cls, config, tmp_path, name: str, init: Callable[[str, torch.Tensor], None]):
    """A tiny transformers `model_cls(config)` drawn at seed 0, each parameter then given `init(name, p)` (under
    no_grad: transformers starts norms and biases at 0 or 1, a released model's are not), saved under tmp_path/name
    -> (the model in eval mode, its directory)."""
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            init(n, p)
    hf.save_pretrained(tmp_path / name)
    return hf, str(tmp_path / name)


def fp64_logits_both_ways(hf, ours, load_back: Callable[[str], torch.nn.Module], tmp_path, x: torch.Tensor) -> dict:
    """Ours (imported from transformers' `hf`) in fp64 gives hf's fp64 logits on `x`, and so does its export loaded back
    by `load_back(directory)`, within 16 fp32 eps of the largest logit (transformers' RMSNorm computes in fp32 in an
    fp64 model: the only fp32 step on either side). Returns the export's config.json."""
    import copy
    with torch.no_grad():
        ref = hf.double()(x).logits
        logits = copy.deepcopy(ours).double()(x)
        tol = 16 * torch.finfo(torch.float32).eps * float(ref.abs().max())
        assert torch.allclose(logits, ref, atol=tol, rtol=0), (logits - ref).abs().max()
        export_hf(ours, str(tmp_path / "out"))
        back = load_back(str(tmp_path / "out")).double().eval()
        assert torch.allclose(back(x).logits, ref, atol=tol, rtol=0)
    with open(tmp_path / "out" / "config.json") as f:
        return json.load(f)


def gradients_equal_transformers(hf, ours, to_hub: Callable[[dict], dict], vocab: int) -> None:
    """One loss and backward through both on the same batch: our loss equals transformers' cross-entropy (1e-5), and
    every gradient of ours equals transformers' for the parameter `to_hub` names (fp32 rounding of the two orders:
    rtol 1e-4 beside 1e-6 of the largest)."""
    hf.train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g)
    loss = ours(x, labels=y)
    ref_loss = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    loss.backward()
    ref_loss.backward()
    names = list(dict(ours.named_parameters()))
    hub = dict(zip(names, to_hub({n: torch.zeros(1) for n in names})))  # (to_hub keeps the order, one name each)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        ref = theirs[hub[name] if hub[name] == "lm_head.weight" else "model." + hub[name]]
        assert torch.allclose(p.grad, ref, atol=1e-6 * float(ref.abs().max()) + 1e-8, rtol=1e-4), name


def each_switch_moves_the_logits(path: str, ref: torch.Tensor, x: torch.Tensor,
                                 mutations: dict[str, Callable]) -> None:
    """Each mutation (a switch turned off on a freshly imported model) moves the logits away from transformers'
    (`ref` on `x`): a switch the forward ignored would leave them."""
    for name, mutate in mutations.items():
        ours = import_hf(path).eval()
        mutate(ours)
        with torch.no_grad():
            assert not torch.allclose(ours(x), ref, atol=1e-3), name


def streamed_export_equals_whole(model, tmp_path, max_shard_bytes: int) -> dict:
    """export_hf_streaming of `model`'s state dict (a sharded run's export, a few tensors at a time) writes the
    tensors and config.json export_hf writes, over more than one shard; returns the config."""
    from safetensors.torch import load_file
    sd = model.state_dict()
    specs = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    _, shards = export_hf_streaming(model.cfg, specs, lambda names: {n: sd[n] for n in names},
                                    str(tmp_path / "streamed"), max_shard_bytes=max_shard_bytes)
    export_hf(model, str(tmp_path / "whole"))
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    streamed = {}
    for f in (tmp_path / "streamed").glob("model-*.safetensors"):
        streamed.update(load_file(str(f)))
    assert shards > 1 and streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[n], whole[n]) for n in whole)
    with open(tmp_path / "streamed" / "config.json") as f, open(tmp_path / "whole" / "config.json") as g:
        config = json.load(f)
        assert config == json.load(g)
    return config


def cache_steps_equal_whole(model, x: torch.Tensor, prefill: int):
    """Token by token through a KV cache (a prefill of `prefill` positions, then one token at a time) each position's
    logits are the whole sequence's (an fp64 `model`: 1e-12); greedy generation with the cache equals it without.
    Returns the cache."""
    from model.generate import generate
    from model.llama import KVCache
    B, T = x.shape
    with torch.no_grad():
        whole = model(x)
        cache = KVCache(model.cfg, B, T, x.device, torch.float64)
        stepped = torch.cat([model(x[:, :prefill], cache=cache)] +
                            [model(x[:, t:t + 1], cache=cache) for t in range(prefill, T)], dim=1)
    assert torch.allclose(stepped, whole, atol=1e-12, rtol=0), (stepped - whole).abs().max()
    a = generate(model, x[:, :4], 8, temperature=0.0, use_cache=True)
    b = generate(model, x[:, :4], 8, temperature=0.0, use_cache=False)
    assert torch.equal(a, b)
    return cache


def packed_documents_attend_alone(model, vocab: int) -> None:
    """Two documents packed in a row (position_ids restarting) give each document's logits alone (an fp64 `model`)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, vocab, (1, 7), generator=g), torch.randint(0, vocab, (1, 9), generator=g)
    pos = torch.cat((torch.arange(7), torch.arange(9)))[None]
    with torch.no_grad():
        packed = model(torch.cat((a, b), dim=1), position_ids=pos)
        alone = torch.cat((model(a), model(b)), dim=1)
    assert torch.allclose(packed, alone, atol=1e-12, rtol=0)


def peft_logits_on_export(model, tmp_path, targets: str, load_hf: Callable, vocab: int):
    """`model` exported (its base weights), then rank-4 LoRA adapters on `targets` (non-zero B) saved in the PEFT
    layout and loaded with `peft.PeftModel` on the export (`load_hf(path)`: the family's fp64 transformers model):
    (our fp64 logits, the base export's, PEFT's) on one batch."""
    import peft
    from model.lora import apply_lora, save_lora
    export_hf(model, str(tmp_path / "base"))
    model.double()
    apply_lora(model, r=4, alpha=8, target_modules=targets)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.05)
    x = torch.randint(0, vocab, (1, 10))
    with torch.no_grad():
        ours, base = model(x), load_hf(str(tmp_path / "base"))(x).logits
    save_lora(model, str(tmp_path / "adapter"))
    pm = peft.PeftModel.from_pretrained(load_hf(str(tmp_path / "base")), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        return ours, base, pm(input_ids=x).logits
