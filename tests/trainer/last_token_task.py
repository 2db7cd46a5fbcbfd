"""A toy task in one file (the test beside it registers it with one line): pretraining data, the loss on each row's
last target token only, averaged over rows, with one statistic of its own. What adding a task takes."""
from __future__ import annotations

import torch

from trainer.tasks.base import Task
from trainer.tasks.pretrain import PretrainTask
from utils.constants import IGNORE_INDEX
from utils.device import to_device


class LastTokenTask(Task):
    name = "last_token"
    units = "rows"
    stat_keys = ("rows_scored",)      # summed per micro-batch; per unit it is 1.0 when every row had a target
    val_stat_keys = ("rows_scored",)

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        return PretrainTask(self.cfg).datasets(tok_meta, val_ratio, fixed_shape, log)

    def micro_batch_loss(self, model, ref_model, batch, device):
        x, y = to_device(batch["input_ids"], device), to_device(batch["labels"], device)
        last = torch.full_like(y, IGNORE_INDEX)
        last[:, -1] = y[:, -1]
        loss = model(x, labels=last, reduction="sum")
        return loss, {"rows_scored": (last[:, -1] != IGNORE_INDEX).float().sum()}

    def count_units(self, batch):
        return int(batch["labels"].shape[0])
