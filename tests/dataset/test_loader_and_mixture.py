"""ResumableLoader (rank-disjoint coverage, resume) and MixtureDataset (weights, determinism)."""
import json
from collections import Counter

import numpy as np
import pytest
import torch

from dataset.loader import FeistelPermutation, ResumableLoader
from dataset.mixture import MixtureDataset, build_pretrain_mixture, parse_data_mix


class Ids:
    """Item i is {"input_ids": [i, i], "labels": [i, -i]}: batches reveal which samples were read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i, i]), "labels": torch.tensor([i, -i])}


def _ids(batch):
    return batch["input_ids"][:, 0].tolist()


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4097])
def test_feistel_is_a_permutation(n):
    p = FeistelPermutation(n, 123)
    full = p(np.arange(n))  # the numpy path for n > 64 ...
    assert sorted(full.tolist()) == list(range(n))
    small = np.concatenate([p(np.arange(i, min(i + 8, n))) for i in range(0, n, 8)])  # ... the int path
    assert np.array_equal(full, small)


def test_two_ranks_two_epochs_disjoint_and_covering():
    n, B, W = 103, 5, 2
    loaders = [ResumableLoader(Ids(n), B, seed=7, rank=r, world_size=W) for r in range(W)]
    steps = n // (B * W)
    assert len(loaders[0]) == steps == 10
    epochs = []
    for _ in range(2):
        per_rank = [[i for _ in range(steps) for i in _ids(next(ld))] for ld in loaders]
        a, b = per_rank
        assert len(a) == len(set(a)) == steps * B and not set(a) & set(b)
        seen = set(a) | set(b)
        assert len(seen) == steps * B * W == n - n % (B * W)  # drop_last drops < B*W samples per epoch
        epochs.append((a, b))
    assert epochs[0][0] != epochs[1][0]  # a fresh permutation each epoch
    assert [ld.state_dict()["epoch"] for ld in loaders] == [2, 2]
    batch = next(loaders[0])
    assert batch["labels"].shape == (B, 2) and batch["labels"].dtype == torch.long


def test_drop_last_false_covers_everything_and_rank_is_constructor_arg():
    n, B, W = 23, 4, 2
    loaders = [ResumableLoader(Ids(n), B, seed=1, rank=r, world_size=W, drop_last=False) for r in range(W)]
    assert len(loaders[0]) == 3
    seen = [i for _ in range(3) for ld in loaders for i in _ids(next(ld))]
    assert set(seen) == set(range(n)) and len(seen) == 24  # one sample wraps around
    with pytest.raises(ValueError):
        ResumableLoader(Ids(n), B, seed=1, rank=2, world_size=2)


def test_pure_function_and_resume_yields_same_batches():
    ds = Ids(200)
    ref = ResumableLoader(ds, 6, seed=3, rank=1, world_size=3)
    for _ in range(14):  # crosses the epoch boundary (11 steps per epoch)
        next(ref)
    sd = ref.state_dict()
    assert sd["epoch"] == 1 and sd["step_in_epoch"] == 3 and all(isinstance(v, int) for v in sd.values())
    expected = [next(ref) for _ in range(12)]
    fresh = ResumableLoader(ds, 6, seed=3, rank=1, world_size=3)
    fresh.load_state_dict(json.loads(json.dumps(sd)))
    got = [next(fresh) for _ in range(12)]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(expected, got))
    assert np.array_equal(fresh.batch_indices(1, 3), ResumableLoader(ds, 6, 3, 1, 3).batch_indices(1, 3))
    with pytest.raises(ValueError, match="num_samples"):
        ResumableLoader(Ids(201), 6, seed=3, rank=1, world_size=3).load_state_dict(sd)
    unshuffled = ResumableLoader(ds, 4, seed=0, rank=1, world_size=2, shuffle=False)
    assert _ids(next(unshuffled)) == [4, 5, 6, 7]


def _step_samples(layout, n_steps, n=203, start=None):
    """{optimizer step: sorted samples read by all ranks' micro-batches} for a (W, B, A) layout."""
    W, B, A = layout
    loaders = [ResumableLoader(Ids(n), B, seed=5, rank=r, world_size=W, samples_per_step=W * B * A)
               for r in range(W)]
    if start is not None:
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(start)))
    out = [sorted(i for ld in loaders for _ in range(A) for i in _ids(next(ld))) for _ in range(n_steps)]
    return out, loaders[0].state_dict()


def test_same_global_batch_reads_the_same_samples_per_step_in_any_layout():
    """G = 16 samples per optimizer step as 2 ranks x 4 x 2 micro-batches, 1 x 4 x 4, 4 x 2 x 2, 1 x 16 x 1:
    each step reads the same 16 samples, across the epoch boundary (203 // 16 = 12 steps per epoch),
    and a cursor saved in one layout continues in any other."""
    layouts = [(2, 4, 2), (1, 4, 4), (4, 2, 2), (1, 16, 1)]
    ref, _ = _step_samples(layouts[0], 30)
    assert all(len(s) == len(set(s)) == 16 for s in ref)
    assert len({i for s in ref[:12] for i in s}) == 12 * 16  # no sample twice within an epoch
    for lay in layouts[1:]:
        assert _step_samples(lay, 30)[0] == ref, lay
    for a in layouts:
        head, cursor = _step_samples(a, 7)
        assert cursor["sample_in_epoch"] == 7 * 16 and cursor["global_batch_size"] == 16
        for b in layouts:
            tail, _ = _step_samples(b, 23, start=cursor)
            assert head + tail == ref, (a, b)
    with pytest.raises(ValueError, match="global_batch_size=16 but this loader has 8"):
        _step_samples((1, 4, 2), 1, start=cursor)
    with pytest.raises(ValueError, match="not a multiple"):  # a cursor in the middle of a step of 3 x 8
        ResumableLoader(Ids(203), 16, seed=5, samples_per_step=16).load_state_dict(dict(cursor, sample_in_epoch=24))
    with pytest.raises(ValueError, match="multiple of batch_size"):
        ResumableLoader(Ids(203), 3, seed=5, world_size=2, samples_per_step=16)


def test_format_1_cursor_still_loads_at_the_same_layout():
    """Checkpoints written before the cursor counted samples hold {epoch, step_in_epoch} in calls of B*W."""
    ds = Ids(200)
    old = {"epoch": 1, "step_in_epoch": 3, "seed": 3, "num_samples": 200, "global_batch_size": 12,
           "shuffle": 1, "drop_last": 1}
    ld = ResumableLoader(ds, 6, seed=3, rank=1, world_size=2)
    ld.load_state_dict(old)
    assert (ld.epoch, ld.step_in_epoch) == (1, 3)
    with pytest.raises(ValueError, match="global_batch_size=12 but this loader has 6"):
        ResumableLoader(ds, 6, seed=3, rank=0, world_size=1).load_state_dict(old)


def test_mixture_follows_weights_regardless_of_sizes():
    small, big = Ids(10), Ids(5000)
    mix = MixtureDataset({"small": small, "big": big}, {"small": 0.7, "big": 0.3}, seed=11, num_samples=4000)
    names = Counter(mix.locate(i)[0] for i in range(len(mix)))
    assert names == {"small": 2800, "big": 1200}  # exact per block of 1000
    locs = [mix.locate(i) for i in range(4000)]
    assert Counter(j for n, j in locs if n == "small") == {j: 280 for j in range(10)}  # small corpus cycles evenly
    big_j = [j for n, j in locs if n == "big"]
    assert len(set(big_j)) == 1200  # the big one is sub-sampled without repeats
    again = MixtureDataset({"small": small, "big": big}, {"small": 0.7, "big": 0.3}, seed=11, num_samples=4000)
    assert [again.locate(i) for i in range(0, 4000, 37)] == locs[::37]
    other = MixtureDataset({"small": small, "big": big}, {"small": 0.7, "big": 0.3}, seed=12, num_samples=4000)
    assert [other.locate(i) for i in range(50)] != locs[:50]
    assert torch.equal(mix[5]["input_ids"], {"small": small, "big": big}[locs[5][0]][locs[5][1]]["input_ids"])
    # through the loader: resumable like any dataset
    ld = ResumableLoader(mix, 8, seed=2)
    [next(ld) for _ in range(3)]
    sd, nxt = ld.state_dict(), next(ld)
    ld2 = ResumableLoader(mix, 8, seed=2)
    ld2.load_state_dict(sd)
    assert torch.equal(next(ld2)["input_ids"], nxt["input_ids"])


def test_data_mix_spec(tmp_path):
    from tests.data_preprocess.test_pretrain_data import _fake_shards
    from data_preprocess.build_pretrain_sample_index_map import build_index
    for name, n in (("zh", 400), ("code", 900)):
        _fake_shards(tmp_path / name, [n])
        build_index(str(tmp_path / name), 8, val_ratio=0.0)
    assert parse_data_mix('{"zh": 0.3, "code": {"path": "/x", "weight": 0.7}}', str(tmp_path)) == \
        {"zh": (str(tmp_path / "zh"), 0.3), "code": ("/x", 0.7)}
    mix = build_pretrain_mixture(json.dumps({"zh": 0.5, "code": 0.5}), 8, data_root=str(tmp_path))
    assert len(mix) == (399 // 8) + (899 // 8)
    assert mix[0]["input_ids"].shape == (8,)
    with pytest.raises(ValueError):
        parse_data_mix('{"zh": "lots"}')
