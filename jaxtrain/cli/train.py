"""`python -m jaxtrain.train --gin_file=F --gin_param='X.y=z' --workdir=DIR`

Trains the experiment the gin config describes (configs/default.gin when no file is given),
resuming from the latest checkpoint in the workdir.

SIGTERM or SIGINT stops the run: before its first step at once, with exit 0 and nothing written
(start-up: jax's start, restore, compilation); from then on after the current step, saved, exit 0
(jaxtrain/resilience/preemption.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxtrain.cli.launch import add_common_flags, fail, start


def harness_evaluator():
    """The task evaluator ObserveConfig.eval_tasks needs; exit 2 naming the install without the harness."""
    try:
        from jaxtrain.harness.training import TrainingTaskEvaluator
    except ImportError as e:
        fail(f"ObserveConfig.eval_tasks needs lm-evaluation-harness ({e}): pip install 'jaxtrain[eval]'")
    return TrainingTaskEvaluator


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.train", description=__doc__)
    add_common_flags(parser)
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and TensorBoard events go here")
    args = parser.parse_args(argv)
    from jaxtrain.resilience.preemption import StopSignals  # (imports no jax)

    signals = StopSignals(exit_in_startup=True).install()  # before jax starts: start-up included
    try:
        return _train(args, signals)
    finally:
        # A run that ends by an error line (SystemExit) must not leave its handlers and start-up
        # watcher behind in a process that goes on, as main() called in-process by tests does:
        # a later SIGTERM would find the watcher and end that process.
        signals.restore()


def _train(args, signals) -> int:
    start(args)

    import gin
    from jaxtrain.training.config import load_experiment
    from jaxtrain.resilience import exit_codes
    from jaxtrain.resilience.exit_codes import RunStopped
    from jaxtrain.generate.during_training import TrainingSampler
    from jaxtrain.training.trainer import Trainer

    try:
        exp = load_experiment()
        task_evaluator = None
        if exp.observe.eval_tasks:  # the harness is imported only by runs that score tasks
            task_evaluator = harness_evaluator()
        trainer = Trainer(exp, args.workdir, config_text=gin.config_str(), sampler=TrainingSampler,
                          task_evaluator=task_evaluator)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    try:  # the workdir (lock, config.gin, checkpoints) is written only from here on
        trainer.run(signals=signals)
    except ValueError as e:  # workdir in use, checkpoints of another model: nothing was changed
        fail(str(e))
    except RunStopped as e:
        if e.code in (exit_codes.CHECKPOINT, exit_codes.PEER, exit_codes.HANG):
            # Background writers or collectives may still be stuck on the failure: exit now,
            # with the one line, rather than through their teardown noise.
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(e.code)
        fail(str(e), code=e.code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
