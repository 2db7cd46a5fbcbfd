"""The files of a Hugging Face export beside its weights: generation_config.json (sample.py's sampling defaults and
its stop ids), the tokenizer's files copied, the special ids config.json gets from tokenizer_meta.json, and every
file's mode as a plain `open` would make it (model/hf_interop.py export_hf and export_hf_streaming call these);
`read_tensors` / `tensor_names`, a directory's tensors or their names (import_hf's read).
Must never: write outside the directory it is given.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer_meta.json")
# not copied from the tokenizer directory (a Hugging Face model's own, say): export writes its own


def generation_config_dict(tokenizer_meta: Optional[dict] = None, stop_ids: Optional[list[int]] = None) -> dict:
    """generation_config.json: sample.py's sampling defaults and its stop ids, `stop_ids` where the caller read
    them from the tokenizer (tokenizer.chat.chat_stop_ids: eos and the chat template's end of turn), else </s> and
    <|im_end|> of a tokenizer_meta.json dict (no ids without one). transformers reads it in from_pretrained."""
    from utils import constants as c
    d: dict = {"do_sample": c.SAMPLE_TEMPERATURE > 0, "temperature": c.SAMPLE_TEMPERATURE,
               "top_k": c.SAMPLE_TOP_K, "top_p": 1.0 if c.SAMPLE_TOP_P is None else c.SAMPLE_TOP_P,
               "max_new_tokens": c.SAMPLE_MAX_NEW_TOKENS}
    st = (tokenizer_meta or {}).get("special_tokens") or {}
    ids = {k: st[k]["id"] for k in ("bos", "eos", "pad", "im_end")
           if isinstance(st.get(k), dict) and isinstance(st[k].get("id"), int)}
    if "bos" in ids:
        d["bos_token_id"] = ids["bos"]
    stops = [int(i) for i in stop_ids] if stop_ids else [ids[k] for k in ("eos", "im_end") if k in ids]
    if stops:
        d["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    if "pad" in ids:
        d["pad_token_id"] = ids["pad"]
    return d


def tokenizer_meta(tokenizer_dir: Optional[str]) -> Optional[dict]:
    path = os.path.join(tokenizer_dir, "tokenizer_meta.json") if tokenizer_dir else ""
    if path and os.path.exists(path):
        with open(path) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    return None


def write_generation_config(tokenizer_dir: Optional[str], dst: str, stop_ids: Optional[list[int]]) -> None:
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(generation_config_dict(tokenizer_meta(tokenizer_dir), stop_ids), f, indent=2)


def plain_file_modes(d: str) -> None:
    """Every file of the export readable as a plain `open` would make it (0666 less the umask): safetensors
    writes its files 0600, and copy2 keeps the source's mode."""
    mode = 0o666 & ~umask()
    for name in os.listdir(d):
        path = os.path.join(d, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, mode)


def umask() -> int:
    try:  # Linux: read without changing it (os.umask sets it, racing other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def special_ids(tokenizer_dir: Optional[str]) -> Optional[dict]:
    meta = tokenizer_meta(tokenizer_dir)
    if meta is None:
        return None
    st = meta.get("special_tokens", {})
    return {f"{k}_token_id": st[k]["id"] for k in ("bos", "eos", "pad") if k in st}


def copy_tokenizer(tokenizer_dir: Optional[str], dst: str) -> None:
    if tokenizer_dir:
        for fn in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, fn)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(dst, fn))


def _weight_files(d: str) -> list[str]:
    """The files holding an HF directory's tensors: model.safetensors, the shards its index names, or
    pytorch_model.bin (FileNotFoundError naming the directory when there are none)."""
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(single):
        return [single]
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(d, fn) for fn in sorted(set(json.load(f)["weight_map"].values()))]
    binf = os.path.join(d, "pytorch_model.bin")
    if os.path.exists(binf):
        return [binf]
    raise FileNotFoundError(f"no model.safetensors, sharded safetensors index or pytorch_model.bin in {d}")


def read_tensors(d: str) -> dict:
    """Every tensor of an HF directory (`_weight_files`)."""
    import torch
    from safetensors.torch import load_file
    sd = {}
    for path in _weight_files(d):
        sd.update(load_file(path) if path.endswith(".safetensors") else
                  torch.load(path, map_location="cpu", weights_only=True))
    return sd


def tensor_names(d: str) -> list[str]:
    """The names of an HF directory's tensors, nothing loaded (safetensors headers; a .bin memory-mapped)."""
    import torch
    from safetensors import safe_open
    names = []
    for path in _weight_files(d):
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                names += list(f.keys())
        else:
            names += list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return names
