"""Benchmark: optimizer memory of full fine-tuning vs embedding + LM head + LoRA (continued pretraining).

    .venv/bin/python bench/bench_cpt_memory.py                 # three measured configs, fp32 and bf16 (~1 min)
    .venv/bin/python bench/bench_cpt_memory.py --dtypes fp32   # fp32 only (half the time)

Issue 15's goal: "Embedding + LoRA training uses <= 1/3 of full fine-tuning's optimizer memory at the
same model". For each model config the same model (same seed) is built twice, once per trainable set,
through the trainer's own path: `model.lora.select_trainable` (what `--trainable=embeddings --lora_rank=8
--lora_targets=all` selects) then `parallel.build.build_engine` with a `TrainConfig` (our DDP, world size 1,
the mixed-precision AdamW). One step (forward + backward + optimizer step, batch 1 x 32 tokens) creates the
state; `optimizer.state_bytes()` reports it (Adam moments, plus fp32 masters when the model runs in bf16).

Measured rows are checked against a closed-form count (bytes per trainable parameter x trainable parameters),
which then gives the ratio for Llama-2-7B-sized models that do not fit this machine's time budget; those rows
are labelled "computed", not measured. Nothing is asserted; the ratio is printed.

Why the ratio depends on the shape: the trainable set is 2 x vocab x dim (embedding + untied LM head) plus
LoRA's r x (in + out) per projection, while full fine-tuning trains ~12 x dim^2 per layer on top. At small
dims (a few layers of dim 512 with a 32k vocabulary) the embedding and head ARE most of the model, and the
ratio is far above 1/3; at Llama-2-7B's shape it is a few percent. Rule of thumb (Llama FFN width, ~12 dim^2
per layer, LoRA neglected): the ratio is <= 1/3 when vocab <= ~3 x layers x dim.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import ModelConfig, Transformer  # noqa: E402
from model.lora import select_trainable, trainable_parameters  # noqa: E402
from parallel.build import build_engine  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402

LORA_RANK = 8
# (name, vocab, dim, layers, heads): measured on this machine
MEASURED = [
    ("demo-sized (vocab 4096, dim 256, 4 layers)", 4096, 256, 4, 8),  # ~ the continued_pretraining.sh model
    ("llama-60M (vocab 32000, dim 512, 8 layers)", 32000, 512, 8, 8),
    ("llama-94M (vocab 8064, dim 1024, 6 layers)", 8064, 1024, 6, 16),
]
# computed only (closed form, validated on the measured rows)
COMPUTED = [
    ("Llama-2-7B (vocab 32000)", 32000, 4096, 32, 32),
    ("Llama-2-7B grown to 49953 (Chinese-LLaMA)", 49953, 4096, 32, 32),
    ("Llama-2-13B grown to 49953", 49953, 5120, 40, 40),
]


def model_cfg(vocab: int, dim: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, max_seq_len=64)


def closed_form(cfg: ModelConfig, r: int = LORA_RANK) -> dict:
    """Parameter counts of the model, and of embedding + LM head + rank-r LoRA on all 7 projections."""
    d, h, v, kv = cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.n_kv_heads * (cfg.dim // cfg.n_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * h + 2 * d  # q,o + k,v + gate,up,down + 2 norms
    total = v * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * per_layer + d
    lora = cfg.n_layers * r * ((d + d) * 2 + (d + kv) * 2 + (d + h) * 2 + (h + d))
    emb = v * d * (1 if cfg.tie_embeddings else 2)
    return {"full": total, "cpt": emb + lora, "emb": emb, "lora": lora}


def bytes_per_trainable(dtype: str) -> int:
    """Adam exp_avg + exp_avg_sq in fp32 (8 B), + a 4 B fp32 master when the model is not fp32."""
    return 8 if dtype == "fp32" else 12


def measure(vocab: int, dim: int, layers: int, heads: int, dtype: str, mode: str) -> dict:
    torch.manual_seed(0)
    mcfg = model_cfg(vocab, dim, layers, heads)
    model = Transformer(mcfg)
    if mode == "full":
        select_trainable(model)
    else:
        select_trainable(model, lora_rank=LORA_RANK, lora_targets="all", train_embeddings=True)
    counts = trainable_parameters(model)
    model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    cfg = TrainConfig(dtype=dtype, device="cpu", learning_rate=1e-4, weight_decay=0.1,
                      lora_rank=LORA_RANK if mode != "full" else 0, lora_targets="all",
                      trainable="embeddings" if mode != "full" else "all")
    engine = build_engine(model, cfg)
    opt = engine.optimizer
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (1, 33), generator=g)
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = engine.model(x[:, :-1], labels=x[:, 1:], reduction="sum")
    opt.scale_loss(loss / 32).backward()
    stepped, _ = opt.step()
    dt = time.perf_counter() - t0
    out = {"trainable": counts["trainable"], "total": counts["total"], "state_bytes": opt.state_bytes(),
           "stepped": bool(stepped), "step_s": dt}
    del engine, opt, model
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CI box has 2 shared cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s); LoRA rank {LORA_RANK} on all 7 projections "
          "+ embedding + LM head (untied) vs full fine-tuning; our DDP + mixed-precision AdamW, world size 1\n")
    rows = []
    for name, v, d, n_l, n_h in MEASURED:
        for dtype in dtypes:
            full = measure(v, d, n_l, n_h, dtype, "full")
            cpt = measure(v, d, n_l, n_h, dtype, "cpt")
            cf = closed_form(model_cfg(v, d, n_l, n_h))
            bpt = bytes_per_trainable(dtype)
            agree = (full["trainable"] == cf["full"] and cpt["trainable"] == cf["cpt"]
                     and full["state_bytes"] == bpt * cf["full"] and cpt["state_bytes"] == bpt * cf["cpt"])
            ratio = cpt["state_bytes"] / full["state_bytes"]
            rows.append((f"{name} {dtype}", "measured", full["total"], cf["emb"] / full["total"],
                         full["state_bytes"], cpt["state_bytes"], ratio))
            print(f"{name}, {dtype}: full {full['trainable']:,} trainable -> optimizer state "
                  f"{mib(full['state_bytes'])}; emb+LoRA {cpt['trainable']:,} trainable "
                  f"(embedding+head {cf['emb']:,}, LoRA {cf['lora']:,}) -> {mib(cpt['state_bytes'])}; "
                  f"ratio {ratio:.3f}; closed form agrees: {agree}", flush=True)
    for name, v, d, n_l, n_h in COMPUTED:
        cf = closed_form(model_cfg(v, d, n_l, n_h))
        for dtype in dtypes:
            bpt = bytes_per_trainable(dtype)
            rows.append((f"{name} {dtype}", "computed", cf["full"], cf["emb"] / cf["full"],
                         bpt * cf["full"], bpt * cf["cpt"], cf["cpt"] / cf["full"]))
    print("\n| model | how | parameters | embedding+head share | full FT optimizer state | emb+LoRA optimizer "
          "state | ratio | <= 1/3 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, how, total, share, fb, cb, ratio in rows:
        print(f"| {name} | {how} | {total / 1e6:,.1f}M | {100 * share:.0f}% | {mib(fb)} | {mib(cb)} | {ratio:.3f} | "
              f"{'yes' if ratio <= 1 / 3 else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
