"""utils/: LR schedules, DPO losses, metrics reading, resplot."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.tasks.dpo import dpo_loss
from utils.lr_schedule import lr_at
from utils.metrics import dedupe_by_step, read_metrics


def test_lr_schedules():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)          # warmup starts at max/warmup
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)        # cosine half way
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_at(35, schedule="linear", **kw) == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    # wsd: constant until the last 20% of decay_iters, then linear to the floor
    assert lr_at(80, schedule="wsd", **kw) == pytest.approx(1.0)
    assert lr_at(110, schedule="wsd", **kw) == pytest.approx(0.1)
    assert 0.1 < lr_at(100, schedule="wsd", **kw) < 1.0
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, schedule="step", **kw)


def test_dpo_losses_values():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    h = (pc - pr) - (rc - rr)  # [1, -2]
    losses, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="sigmoid")
    assert torch.allclose(losses, -F.logsigmoid(0.5 * h))
    assert torch.allclose(cr, 0.5 * (pc - rc)) and torch.allclose(rj, 0.5 * (pr - rr))
    smooth, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    assert torch.allclose(smooth, -0.9 * F.logsigmoid(0.5 * h) - 0.1 * F.logsigmoid(-0.5 * h))
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    assert torch.allclose(ipo, (h - 1.0) ** 2)
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")
    assert torch.allclose(hinge, torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")


def test_metrics_reader_tolerates_torn_line_and_dedupes(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    recs = read_metrics(str(p))
    assert len(recs) == 3
    assert {s: r["loss"] for s, r in dedupe_by_step(recs).items()} == {1: 3.0, 2: 2.4}


def test_resplot_writes_png(tmp_path):
    from utils.resplot import main
    for name, scale in (("a", 1.0), ("b", 0.8)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for s in range(1, 21):
                rec = {"step": s, "loss": scale * 5 / s, "lr": 1e-3, "tokens_per_sec": 1000.0}
                if s % 5 == 0:
                    rec["val_loss"] = scale * 6 / s
                f.write(json.dumps(rec) + "\n")
    out = tmp_path / "cmp.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main([str(tmp_path / "missing")]) == 2


def test_schedule_warnings_name_what_no_longer_makes_sense():
    from utils.lr_schedule import lr_at, schedule_warnings
    ok = schedule_warnings(max_iters=1000, warmup_iters=100, lr_decay_iters=0, schedule="cosine")
    assert ok == []
    w = schedule_warnings(max_iters=50, warmup_iters=100, lr_decay_iters=0, schedule="cosine")
    assert len(w) == 1 and "never trains at the peak" in w[0]
    assert lr_at(49, max_lr=1.0, min_lr=0.1, warmup_iters=100, decay_iters=50) < 1.0  # what the warning says
    w = schedule_warnings(max_iters=1000, warmup_iters=100, lr_decay_iters=80, schedule="cosine")
    assert any("drops to --min_lr right after the warmup" in s for s in w)
    # a deliberate decay shorter or longer than the run is not second-guessed at the start ...
    assert schedule_warnings(max_iters=1000, warmup_iters=10, lr_decay_iters=600, schedule="cosine") == []
    # ... but a resume that cuts the run short of its decay is
    w = schedule_warnings(max_iters=800, warmup_iters=10, lr_decay_iters=1000, schedule="cosine", resumed_at=500,
                          saved_max_iters=1000)
    assert any("stops before the learning rate has decayed" in s for s in w)
    # a resume that extends max_iters: with the decay tied to max_iters the curve jumps ...
    w = schedule_warnings(max_iters=2000, warmup_iters=10, lr_decay_iters=0, schedule="cosine", resumed_at=900,
                          saved_max_iters=1000)
    assert any("jumps from the old curve" in s for s in w)
    a = lr_at(900, max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=1000)
    b = lr_at(900, max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=2000)
    assert b - a > 0.3  # the jump is real
    # ... and past a pinned decay it sits at the floor
    w = schedule_warnings(max_iters=2000, warmup_iters=10, lr_decay_iters=1000, schedule="cosine", resumed_at=900,
                          saved_max_iters=1000)
    assert any("steps 1001-2000 run at --min_lr" in s for s in w)
    assert schedule_warnings(max_iters=2000, warmup_iters=10, lr_decay_iters=0, schedule="constant",
                             resumed_at=900, saved_max_iters=1000) == []


def test_reference_free_losses_values():
    """SimPO and ORPO on hand-picked sums and lengths, against the papers' formulas evaluated in Python floats."""

    from trainer.tasks.dpo import reference_free_loss
    pc, nc = torch.tensor([-4.0, -6.0]), torch.tensor([2, 3])    # chosen mean log-probs -2, -2
    pr, nr = torch.tensor([-9.0, -2.0]), torch.tensor([3, 1])    # rejected -3, -2
    logsig = lambda z: -math.log1p(math.exp(-z))  # noqa: E731
    simpo, cr, rj = reference_free_loss(pc, pr, nc, nr, beta=2.0, loss_type="simpo", gamma=0.5)
    want = [-logsig(2.0 * (-2 + 3) - 0.5), -logsig(2.0 * (-2 + 2) - 0.5)]
    assert torch.allclose(simpo, torch.tensor(want)) and torch.allclose(cr, torch.tensor([-4.0, -4.0]))
    smooth, _, _ = reference_free_loss(pc, pr, nc, nr, beta=2.0, loss_type="simpo", gamma=0.5, label_smoothing=0.2)
    assert torch.allclose(smooth, torch.tensor([0.8 * -logsig(1.5) + 0.2 * -logsig(-1.5),
                                                0.8 * -logsig(-0.5) + 0.2 * -logsig(0.5)]))
    orpo, _, rj = reference_free_loss(pc, pr, nc, nr, beta=0.1, loss_type="orpo")
    odds = lambda x: x - math.log(1 - math.exp(x))  # noqa: E731
    want = [2.0 - 0.1 * logsig(odds(-2) - odds(-3)), 2.0 - 0.1 * logsig(odds(-2) - odds(-2))]
    assert torch.allclose(orpo, torch.tensor(want)) and torch.allclose(rj, torch.tensor([-0.3, -0.2]))
    with pytest.raises(ValueError):
        reference_free_loss(pc, pr, nc, nr, loss_type="sigmoid")
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, pc, pr, loss_type="simpo")  # (not against a reference)


def test_trls_other_dpo_losses_values():
    """robust, exo_pair, nca_pair, sppo_hard, apo_zero, apo_down, discopop on hand values, against their papers'
    formulas (as TRL's DPOTrainer writes them) evaluated in Python floats; the trainer accepts exactly these."""
    import math

    from trainer.config import DPO_LOSSES, REFERENCE_FREE_LOSSES
    from trainer.tasks.dpo import reference_free_loss
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.2, -2.5])
    for kind in DPO_LOSSES:  # every choice of the flag is computed, finite, by one of the two functions
        got = reference_free_loss(pc, pr, torch.tensor([2, 3]), torch.tensor([3, 1]), loss_type=kind)[0] \
            if kind in REFERENCE_FREE_LOSSES else dpo_loss(pc, pr, rc, rr, loss_type=kind)[0]
        assert got.shape == (2,) and bool(torch.isfinite(got).all()), kind
    beta, eps = 0.5, 0.1
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    ls = lambda x: math.log(sig(x))  # noqa: E731
    for i in range(2):
        a, b = beta * (pc[i] - rc[i]).item(), beta * (pr[i] - rr[i]).item()
        z = a - b
        want = {
            "robust": (-(1 - eps) * ls(z) + eps * ls(-z)) / (1 - 2 * eps),
            "exo_pair": sig(z) * (ls(z) - math.log(1 - eps)) + sig(-z) * (ls(-z) - math.log(eps)),
            "nca_pair": -ls(a) - 0.5 * ls(-a) - 0.5 * ls(-b),
            "sppo_hard": (a / beta - 1 / (2 * beta)) ** 2 + (b / beta + 1 / (2 * beta)) ** 2,
            "apo_zero": 1 - sig(a) + sig(b),
            "apo_down": sig(a) + 1 - sig(a - b),
            "discopop": -ls(z) * (1 - sig(z / 0.05)) + math.exp(-z) * sig(z / 0.05),
        }
        for kind, value in want.items():
            got = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=kind, label_smoothing=eps)[0][i].item()
            assert abs(got - value) < 1e-5 * max(1.0, abs(value)), (kind, got, value)
    # AOT (Melnyk et al. 2024): the log-ratios sorted over the pairs, then sigmoid's loss with label smoothing
    pc, pr = [-1.0, -3.0, -0.5], [-2.0, -1.0, -0.7]
    rc, rr = [-1.5, -2.0, -0.4], [-1.2, -2.5, -1.0]
    pairs = {"aot": (sorted(c - r for c, r in zip(pc, pr)), sorted(c - r for c, r in zip(rc, rr))),
             "aot_unpaired": (sorted(p - r for p, r in zip(pc, rc)), sorted(p - r for p, r in zip(pr, rr)))}
    pairs["aot_pair"] = pairs["aot_unpaired"]
    for kind, (mine, other) in pairs.items():
        got = dpo_loss(*(torch.tensor(v) for v in (pc, pr, rc, rr)), beta=beta, loss_type=kind, label_smoothing=eps)
        for i in range(3):
            z = beta * (mine[i] - other[i])
            want = -(1 - eps) * ls(z) - eps * ls(-z)
            assert abs(got[0][i].item() - want) < 1e-5 * max(1.0, abs(want)), (kind, i, got[0][i].item(), want)


def test_rpo_adds_the_chosen_replys_per_token_nll():
    """--rpo_alpha: each pair's loss grows by alpha x the chosen reply's mean token NLL (computed here from the
    model's own cross-entropy)."""
    from types import SimpleNamespace

    from model import ModelConfig, Transformer
    from trainer.tasks.dpo import DPOTask
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=16))
    ids = torch.randint(0, 32, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 8:] = -100
    batch = {"chosen_input_ids": ids, "chosen_labels": labels, "rejected_input_ids": ids.flip(1),
             "rejected_labels": labels.flip(1)}
    cfg = dict(dpo_beta=0.1, dpo_loss="sigmoid", dpo_loss_weights="", dpo_label_smoothing=0.0, discopop_tau=0.05,
               simpo_gamma=0.5)
    plain, _ = DPOTask(SimpleNamespace(**cfg, rpo_alpha=0.0)).micro_batch_loss(model, model, batch, "cpu")
    rpo, _ = DPOTask(SimpleNamespace(**cfg, rpo_alpha=2.0)).micro_batch_loss(model, model, batch, "cpu")
    with torch.no_grad():
        logits = model(ids)
    nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 10)
    per_pair = nll.sum(1) / (labels != -100).sum(1)
    assert abs(float(rpo - plain) - 2.0 * float(per_pair.sum())) < 1e-4


def test_reference_free_losses_refuse_a_reference_and_rpo():
    from trainer.config import TrainConfig, TrainingError
    from trainer.validation import validate_config
    base = dict(data_dir="d", tokenizer_dir="t", task_type="dpo", init_from="x")
    validate_config(TrainConfig(**base, dpo_loss="simpo"), torch_free=True)
    for bad, why in ((dict(dpo_loss="simpo", ref_model="r"), "--ref_model: --dpo_loss=simpo is reference-free"),
                     (dict(dpo_loss="orpo", rpo_alpha=1.0), "--rpo_alpha: --dpo_loss=orpo is reference-free"),
                     (dict(dpo_loss="kto"), "--dpo_loss='kto'")):
        with pytest.raises(TrainingError, match=why):
            validate_config(TrainConfig(**base, **bad), torch_free=True)
