"""The train state and its shardings, importable from the training package: the code
lives in jaxtrain/train_state.py, below both training and pipeline (which builds its staged state on
it while training assembles the pipeline), so neither package imports the other round a loop."""
from jaxtrain.train_state import (  # noqa: F401
    TrainState, abstract_model, count_params, in_memory, init_state, map_param_leaves, map_with_path,
    optimizer_roles, optimizer_shardings, param_shardings, shardings_by_path, state_shardings, with_shardings)
