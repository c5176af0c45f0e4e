"""`python tests/faults/peer_faults.py <train CLI args>`: the train CLI with faults for the
resilience tests, in the process FAULT_PROCESS (its --process_id; default: every process).

  FAULT_STEP_SLEEP=S    every train step sleeps S seconds first (signals land mid-step)
  FAULT_HANG_STEP=N     the N-th train step of this run sleeps 10 minutes (a hang)
  FAULT_SAVE_FAILS=N    the save of step N raises OSError (ENOSPC) in this process
  FAULT_HANG_IN=PART    restore | save | eval: each call of that part prints `fault: in PART` and
                        sleeps FAULT_HANG_S seconds (default 600: a hang) before doing its work
  FAULT_FIRST_STEP_S=S  the first train step prints `fault: in the first step` and sleeps S seconds
                        before its dispatch (where it compiles)
"""
import errno
import os
import sys
import time

from jaxtrain.checkpoints import checkpointer as checkpoint
from jaxtrain.cli import train
from jaxtrain.training import trainer


def _delayed(method, part: str, seconds: float):
    def delayed(*a, **k):
        print(f"fault: in {part}", flush=True)
        time.sleep(seconds)
        return method(*a, **k)
    return delayed


def _this_process(argv) -> bool:
    wanted = os.environ.get("FAULT_PROCESS")
    ids = [a.split("=", 1)[1] for a in argv if a.startswith("--process_id=")]
    return wanted is None or (ids[0] if ids else "0") == wanted


def _patch() -> None:
    sleep = float(os.environ.get("FAULT_STEP_SLEEP", "0"))
    hang = int(os.environ.get("FAULT_HANG_STEP", "0"))
    fails = int(os.environ.get("FAULT_SAVE_FAILS", "0"))
    first = float(os.environ.get("FAULT_FIRST_STEP_S", "0"))
    build = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        step, calls = self.setup.train_step, [0]  # the one assembled step (training/train_setup.py)

        def slow_step(*a, **k):
            calls[0] += 1
            if calls[0] == 1 and first:
                print("fault: in the first step", flush=True)
                time.sleep(first)
            if calls[0] == hang:
                time.sleep(600)
            time.sleep(sleep)
            return step(*a, **k)
        self.setup.train_step = slow_step

    if sleep or hang or first:
        trainer.Trainer.__init__ = init
    part, seconds = os.environ.get("FAULT_HANG_IN"), float(os.environ.get("FAULT_HANG_S", "600"))
    if part:
        owner, name = {"restore": (trainer.Trainer, "restore_or_init"), "eval": (trainer.Trainer, "evaluate"),
                       "save": (checkpoint.Checkpointer, "save")}[part]
        setattr(owner, name, _delayed(getattr(owner, name), part, seconds))
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
