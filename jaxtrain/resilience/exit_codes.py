"""Process exit codes, one per kind of ending, so a scheduler (or a test) can tell them apart."""
OK = 0  # finished, or stopped cleanly on SIGTERM/SIGINT after saving the current step
BAD_INPUT = 2  # config, data, layout or checkpoint-compatibility error, before anything is written
NON_FINITE = 3  # loss or gradients not finite under the `halt` policy (or too many skips)
CHECKPOINT = 4  # a checkpoint could not be saved or no intact checkpoint could be restored
PEER = 5  # another process is missing, died, or reported a failure
HANG = 6  # a step took far longer than usual (every thread's stack is in the log)
INTERRUPTED = 130  # a second SIGINT: out at once, without saving (the shell's 128 + SIGINT)


class RunStopped(Exception):
    """The run cannot go on; `code` is the exit code the CLI ends with, `str()` its one line."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
