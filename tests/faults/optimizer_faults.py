"""`python tests/faults/optimizer_faults.py <train CLI args>`: the train CLI with another optimizer.

  FAULT_MOMENTUM_TRACE=1  the optimizer chain gains a stateful transform (a momentum trace of
                          every parameter): an optimizer state of another structure than the
                          checkpoints in the workdir hold, as a change of optimizer would make
  FAULT_NO_DECAY=a,b      the parameters whose path ends with one of these names declare the
                          optimizer role "no_decay" (as models/layers/params.py would after a change)
"""
import os
import sys

import optax

from jaxtrain.cli import train
from jaxtrain.training import train_setup, trainer


def _patch() -> None:
    no_decay = tuple(n for n in os.environ.get("FAULT_NO_DECAY", "").split(",") if n)
    if no_decay:
        declared = train_setup.optimizer_roles

        def roles(model_cfg):
            return {path: "no_decay" if "/".join(map(str, path)).endswith(no_decay) else role
                    for path, role in declared(model_cfg).items()}

        train_setup.optimizer_roles = trainer.optimizer_roles = roles
    if os.environ.get("FAULT_MOMENTUM_TRACE") != "1":
        return
    original = train_setup.make_optimizer

    def with_trace(*args, **kwargs):
        tx, schedule = original(*args, **kwargs)
        return optax.chain(tx, optax.trace(decay=0.5)), schedule

    train_setup.make_optimizer = with_trace


if __name__ == "__main__":
    _patch()
    sys.exit(train.main(sys.argv[1:]))
