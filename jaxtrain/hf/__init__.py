"""Hugging Face checkpoints <-> jaxtrain models.

    model = hf.load("path/to/hf_dir", mesh=mesh)   # ready NNX model, born sharded
    hf.save(model, "path/to/out")                  # transformers.AutoModelForCausalLM loads it

Lower level, for converters: `read_config` (config.json -> our config, strictly),
`import_plan` / `iter_params` (our parameters, one layer at a time), `ExportPlan` +
`write_hf_dir` (any source of our parameters -> an HF dir). Each model family is one module
in jaxtrain/hf/families/ declaring its config translation and tensor table.
"""
from jaxtrain.hf.errors import HFCheckpointError, HFConfigError
from jaxtrain.hf.exporter import ExportPlan, write_hf_dir
from jaxtrain.hf.importer import ImportPlan, ParamPiece
from jaxtrain.hf.loading import import_plan, iter_params, load, read_config
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.hf.registry import families, family_for_config, family_for_model_type
from jaxtrain.hf.saving import save

__all__ = [
    "load", "save", "read_config", "import_plan", "iter_params", "ImportPlan", "ParamPiece", "ExportPlan",
    "write_hf_dir", "Family", "TensorMap", "families", "family_for_config", "family_for_model_type",
    "HFCheckpointError", "HFConfigError",
]
