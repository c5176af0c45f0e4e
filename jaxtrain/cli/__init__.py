"""The command-line programs (`python -m jaxtrain.train|eval|bench|convert` run these)."""
