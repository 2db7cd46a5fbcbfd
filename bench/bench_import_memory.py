"""Benchmark the peak memory of reading a Hugging Face checkpoint into an fp32 model: ours (`model/hf_interop.py
import_hf`: the model built on the meta device takes each converted tensor as it is, the checkpoint's tensor dropped
as soon as its copy exists) against transformers' `AutoModelForCausalLM.from_pretrained(dtype=torch.float32)` on the
same directory, side by side in one run.

Owns: two random bf16 checkpoints written once into --work_dir (a dense Llama and a Mixtral-style MoE, whose experts
both sides stack into new tensors), and the measurement: each load in a fresh process, a thread sampling the process's
anonymous resident memory (/proc/self/status RssAnon: the safetensors files themselves are mapped, file-backed pages
the kernel can drop) every 5 ms; printed as bytes per parameter above the process's memory before the load (the fp32
result alone is 4), and the ratio ours / transformers'.
Must never: assert anything (it prints), download anything, or write outside --work_dir.

    .venv/bin/python bench/bench_import_memory.py [--work_dir=/tmp/bench_import_memory] [--dim=1024] [--n_layers=16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOAD = r"""
import json, sys, threading, time
sys.path.insert(0, {root!r})
import torch

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024

peak, stop = [0], [False]
def watch():
    while not stop[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)

if {side!r} == "ours":
    from model.hf_interop import import_hf
    load = lambda: import_hf({path!r})
else:
    from transformers import AutoModelForCausalLM
    load = lambda: AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)
base = anon()
thread = threading.Thread(target=watch)
thread.start()
model = load()
stop[0] = True
thread.join()
n = sum(p.numel() for p in model.parameters())
print(json.dumps({{"params": n, "bytes_per_param": (max(peak[0], anon()) - base) / n}}))
"""


def _checkpoints(work: str, dim: int, n_layers: int) -> dict[str, str]:
    """The two bf16 checkpoints (written once): {name: directory}."""
    import torch

    from model import ModelConfig, Transformer
    from model.hf_interop import export_hf
    shapes = {"dense": dict(vocab_size=32000, dim=dim, n_layers=n_layers, n_heads=max(1, dim // 64)),
              "moe": dict(vocab_size=8000, dim=dim // 2, n_layers=n_layers // 2, n_heads=max(1, dim // 128),
                          moe_num_experts=16, moe_top_k=2, moe_hidden_dim=dim)}
    out = {}
    for name, shape in shapes.items():
        path = os.path.join(work, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            torch.manual_seed(0)
            export_hf(Transformer(ModelConfig(max_seq_len=512, **shape)).to(torch.bfloat16), path)
        out[name] = path
    return out


def _peak(side: str, path: str) -> dict:
    code = _LOAD.format(root=ROOT, side=side, path=path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{side} on {path}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work_dir", default="/tmp/bench_import_memory")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=16)
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.makedirs(a.work_dir, exist_ok=True)
    for name, path in _checkpoints(a.work_dir, a.dim, a.n_layers).items():
        ours, hf = _peak("ours", path), _peak("hf", path)
        print(f"[bench_import_memory] {name}: {ours['params'] / 1e6:.0f}M parameters, bf16 safetensors -> fp32; "
              f"peak anonymous memory above the start: ours {ours['bytes_per_param']:.2f} bytes/param, "
              f"transformers {hf['bytes_per_param']:.2f}; ratio {ours['bytes_per_param'] / hf['bytes_per_param']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
