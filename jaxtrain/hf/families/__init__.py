"""One module per model family; each defines `FAMILY` (a jaxtrain.hf.mapping.Family).

Adding a family is adding a module here: jaxtrain.hf.registry finds it by scanning this package.
"""
