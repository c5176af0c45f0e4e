"""`python tests/faults/peer_faults.py <train CLI args>`: the train CLI with faults for the
resilience tests, in the process FAULT_PROCESS (its --process_id; default: every process).

  FAULT_STEP_SLEEP=S    every train step sleeps S seconds first (signals land mid-step)
  FAULT_HANG_STEP=N     the N-th train step of this run sleeps 10 minutes (a hang)
  FAULT_SAVE_FAILS=N    the save of step N raises OSError (ENOSPC) in this process
"""
import errno
import os
import sys
import time

from jaxtrain.checkpoints import checkpointer as checkpoint
from jaxtrain.cli import train
from jaxtrain.training import trainer


def _this_process(argv) -> bool:
    wanted = os.environ.get("FAULT_PROCESS")
    ids = [a.split("=", 1)[1] for a in argv if a.startswith("--process_id=")]
    return wanted is None or (ids[0] if ids else "0") == wanted


def _patch() -> None:
    sleep = float(os.environ.get("FAULT_STEP_SLEEP", "0"))
    hang = int(os.environ.get("FAULT_HANG_STEP", "0"))
    fails = int(os.environ.get("FAULT_SAVE_FAILS", "0"))
    build = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        step, calls = self.train_step, [0]

        def slow_step(*a, **k):
            calls[0] += 1
            if calls[0] == hang:
                time.sleep(600)
            time.sleep(sleep)
            return step(*a, **k)
        self.train_step = slow_step

    if sleep or hang:
        trainer.Trainer.__init__ = init
    if fails:
        save = checkpoint.Checkpointer.save

        def failing_save(self, step, *args, **kwargs):
            if step == fails:
                def no_space(*_, **__):
                    raise OSError(errno.ENOSPC, "No space left on device")
                self.manager.save = no_space
            return save(self, step, *args, **kwargs)
        checkpoint.Checkpointer.save = failing_save


if __name__ == "__main__":
    if _this_process(sys.argv[1:]):
        _patch()
    sys.exit(train.main(sys.argv[1:]))
