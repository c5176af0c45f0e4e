"""`python tests/faults/save_faults.py <train CLI args>`: the train CLI with its checkpoint save
sabotaged at step FAULT_SAVE_STEP.

  FAULT_KILL=before   SIGKILL as the save is called (nothing of the step written)
  FAULT_KILL=during   SIGKILL as soon as Orbax's temporary step directory holds a file
  FAULT_KILL=after    SIGKILL once the step is committed, before training goes on
  FAULT_NO_SPACE=1    the save's writes fail with ENOSPC (for where a small tmpfs can't be mounted)
"""
import errno
import os
import signal
import sys
import threading
import time

from jaxtrain.checkpoints import checkpointer as checkpoint
from jaxtrain.cli import train


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_when_a_temporary_step_has_files(directory: str, step: int):
    def watch():
        while True:
            for name in os.listdir(directory) if os.path.isdir(directory) else ():
                path = os.path.join(directory, name)
                if name.startswith(f"{step}.") and "tmp" in name and any(files for _, _, files in os.walk(path)):
                    _kill()
            time.sleep(0.0005)
    threading.Thread(target=watch, daemon=True).start()


def _patch() -> None:
    step_to_break, how = int(os.environ["FAULT_SAVE_STEP"]), os.environ.get("FAULT_KILL")
    original = checkpoint.Checkpointer.save

    def save(self, step, *args, **kwargs):
        if step != step_to_break:
            return original(self, step, *args, **kwargs)
        self.wait()  # earlier steps committed: the fault hits this step's save alone
        if how == "before":
            _kill()
        if how == "during":
            _kill_when_a_temporary_step_has_files(self.directory, step)
        if os.environ.get("FAULT_NO_SPACE"):
            def no_space(*_, **__):
                raise OSError(errno.ENOSPC, "No space left on device")
            self.manager.save = no_space
        original(self, step, *args, **kwargs)
        if how == "after":
            self.wait()
            _kill()
        if how == "during":
            self.wait()
            time.sleep(5)  # the watcher must have fired by now; if not, the test sees a clean exit

    checkpoint.Checkpointer.save = save


if __name__ == "__main__":
    _patch()
    sys.exit(train.main(sys.argv[1:]))
