"""The training step the benchmarks time (``bench_end_to_end.py``, ``bench_training.py``)."""

from __future__ import annotations

import torch


def make_train_step(fn, optimizer, ids, autocast: bool = False):
    """One training step of the (compiled) model ``fn``: forward with labels (under bf16 CUDA autocast
    when ``autocast``), backward, optimizer step. ``ids``: [B, S] token ids, also the labels."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step
