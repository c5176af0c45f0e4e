"""Model families are records (models/family.py): each registered config provides the model
protocol with one signature, counts its own parameters right, and a new family is one file."""
import dataclasses

import gin
import jax
import pytest
from flax import nnx

import jaxtrain.training.config  # noqa: F401  (the whole gin registry, as a run has it)
from jaxtrain.models.family import _FAMILIES, FamilyConfig, ModelConfig, families, family_of, model_family
from jaxtrain.models.llama import LlamaConfig, build_llama

pytestmark = [pytest.mark.fast]


def test_every_family_file_registers_itself():
    assert set(families()) == {"llama", "deepseek_v2", "nemotron_h", "mamba2"}
    for family in families().values():
        config = family.config_class()
        assert isinstance(config, ModelConfig) and family_of(config) is family
        total, active = config.param_count(), config.param_count(active_only=True)
        assert 0 < config.param_count(include_embeddings=False) < total and 0 < active <= total
        built = nnx.eval_shape(lambda: config.build(nnx.Rngs(0)))
        counted = sum(x.size for x in jax.tree.leaves(nnx.state(built)))
        assert counted == total, family.name
        assert config.flops_per_token(128) > 6 * active * 0.5


def test_a_new_family_is_one_decorated_class_usable_from_gin():
    @model_family("tiny_test_family", "a Llama under another name, for this test")
    @dataclasses.dataclass(frozen=True)
    class TinyFamilyConfig(LlamaConfig):
        def build(self, rngs):
            return build_llama(self, rngs)

    try:
        assert families()["tiny_test_family"].config_class is TinyFamilyConfig
        gin.parse_config("TinyFamilyConfig.layers = 3")
        built = gin.get_configurable("models.TinyFamilyConfig")()
        assert isinstance(built, TinyFamilyConfig) and built.layers == 3
    finally:
        gin.clear_config()
        _FAMILIES.pop("tiny_test_family")


def test_a_config_missing_part_of_the_protocol_is_refused_at_definition():
    with pytest.raises(TypeError, match="lacks \\['flops_per_token'\\]"):
        @model_family("broken", "")
        @dataclasses.dataclass(frozen=True)
        class NoFlops(FamilyConfig):
            vocab_size: int = 8
            remat: str = "none"

            def validate(self, mesh_sizes): ...

            def build(self, rngs): ...

            def param_count(self, include_embeddings=True, active_only=False): ...

    with pytest.raises(TypeError, match="param_count must take"):
        @model_family("broken", "")
        @dataclasses.dataclass(frozen=True)
        class OldCount(FamilyConfig):
            vocab_size: int = 8
            remat: str = "none"

            def validate(self, mesh_sizes): ...

            def build(self, rngs): ...

            def param_count(self, include_embeddings=True): ...

            def flops_per_token(self, seq_len): ...
