"""`python tests/faults/data_faults.py <train CLI args>`: the train CLI with its data patched.

  FAULT_POISON_BATCH=k  batch k (0-based, in the order the iterator yields) holds a token id
                        past the model's vocabulary, which embeds as NaN: the step is not finite
  FAULT_DROP_BATCH=k    batch k never exists (later batches move up by one): the reference for
                        a run that skips batch k
"""
import os
import sys

from jaxtrain.cli import train
from jaxtrain.data import packing as data


def _patch() -> None:
    poison, drop = (int(os.environ[k]) if k in os.environ else None for k in ("FAULT_POISON_BATCH", "FAULT_DROP_BATCH"))
    original = data._TrainBatchAtStep.__call__

    def batch_at(self, index):
        index = int(index)
        if drop is not None and index >= drop:
            index += 1
        batch = original(self, index)
        if poison is not None and index == poison:
            batch = {**batch, "inputs": batch["inputs"].copy()}
            batch["inputs"][0, 3] = 1_000_000
        return batch

    data._TrainBatchAtStep.__call__ = batch_at


if __name__ == "__main__":
    _patch()
    sys.exit(train.main(sys.argv[1:]))
