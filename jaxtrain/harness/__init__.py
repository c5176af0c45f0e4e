"""jaxtrain as a model backend of EleutherAI's lm-evaluation-harness.

- scoring.py: log-probabilities of token sequences on the model's mesh, one compile per length bucket;
- lm.py: the harness's `LM` interface (`JaxtrainLM`, registered as model `jaxtrain` on import);
- tasks.py: running tasks through the harness and writing its results;
- training.py: task scores while a run trains (`ObserveConfig.eval_tasks`).

`python -m jaxtrain.eval --tasks ...` is the jaxtrain-side program; `python -m jaxtrain.harness`
is the harness's own CLI (`lm_eval run ...`) with the `jaxtrain` model registered. The harness is
an optional dependency (`pip install 'jaxtrain[eval]'`); nothing here is imported by training
unless a run asks for task scores.
"""
