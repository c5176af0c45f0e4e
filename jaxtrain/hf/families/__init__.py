"""One module per model family; each defines `FAMILY` (a jaxtrain.hf.mapping.Family).

Adding a family's HF adapter is adding a module here and naming it in the family's record
(`@model_family(..., hf_adapter="jaxtrain.hf.families.<module>")`, models/family.py);
jaxtrain.hf.registry is a view over those records.
"""
