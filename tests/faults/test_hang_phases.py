"""The watchdog covers the whole run, not only the steps after the warm-up: a hang in the restore,
in the first step (where it compiles), in a save or in an eval fires it through the real CLI on a
tiny model, with a line naming the phase and its bound, every thread's stack, and exit HANG.
Each part hangs by injection (tests/faults/peer_faults.py FAULT_HANG_IN, FAULT_HANG_STEP) under a
bound of a few seconds; a restore, save or eval hangs 30 s, so that a run whose watchdog misses it
ends (exit 0) instead of running into the test's timeout."""
import re

import pytest

from cli_runs import steps_on_disk, train
from jaxtrain.resilience import exit_codes

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end, pytest.mark.extended]

BOUND = 3  # seconds: the bound of the hanging part; the others keep their generous defaults
HANG = {"FAULT_HANG_S": "30"}

CASES = {  # part: (the bindings that make the part happen and bound it, the fault, the phase's words)
    "restore": ([f"ResilienceConfig.hang_restore_s={BOUND}"], {"FAULT_HANG_IN": "restore", **HANG},
                r"the restore of the newest checkpoint \(or the initialization\) has not finished after \d+ s, "
                rf"over the bound ResilienceConfig.hang_restore_s={BOUND}"),
    "first step": ([f"ResilienceConfig.hang_first_steps_s={BOUND}"], {"FAULT_HANG_STEP": "1"},
                   r"no step finished for \d+ s \(step 1 in flight, among the first 2 steps, compilation "
                   rf"included\), over the bound ResilienceConfig.hang_first_steps_s={BOUND}"),
    "save": ([f"ResilienceConfig.hang_save_s={BOUND}", "CheckpointConfig.checkpoint_every=2"], {"FAULT_HANG_IN": "save", **HANG},
             rf"the save of step 2 has not finished after \d+ s, over the bound ResilienceConfig.hang_save_s={BOUND}"),
    "eval": ([f"ResilienceConfig.hang_eval_s={BOUND}", "ObserveConfig.eval_every=2"], {"FAULT_HANG_IN": "eval", **HANG},
             rf"the eval at step 2 has not finished after \d+ s, over the bound ResilienceConfig.hang_eval_s={BOUND}"),
}


@pytest.mark.parametrize("part", list(CASES))
def test_a_hang_in_each_part_of_the_run_fires_the_watchdog_naming_it(tmp_path, part):
    bindings, fault, words = CASES[part]
    proc = train(tmp_path / "run", "TrainConfig.steps=6", *bindings, wrapper="peer_faults.py", fault_env=fault,
                 timeout=180)
    assert proc.returncode == exit_codes.HANG, (proc.returncode, proc.stderr[-3000:])
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert re.fullmatch(rf"error: process 0: hung: {words}; every thread's stack follows", line), line
    assert "jaxtrain/resilience/watchdog.py" in proc.stderr  # the stacks: the watchdog's own thread
    hung_in = {"restore": "in restore_or_init", "first step": "in slow_step", "save": "in save",
               "eval": "in evaluate"}[part]
    assert "in delayed" in proc.stderr or hung_in in proc.stderr  # and the main thread, where it hangs
    assert steps_on_disk(tmp_path / "run") == []  # nothing was saved before the hang
