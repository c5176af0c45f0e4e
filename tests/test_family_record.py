"""One record per model family (models/family.py): its config, the parts its gin files name
(registered by the record, not by a central list), its HF adapter (jaxtrain/hf/registry.py is a
view of the records) and its runtime settings behind `runtime()` / `with_runtime()`. Old gin
files still load: every bundled config, and a config.gin saved by a run before the records."""
import dataclasses
import importlib
import os
import pkgutil

import gin
import pytest

import jaxtrain.hf.families as hf_families_pkg
from jaxtrain.hf import registry as hf_registry
from helpers import bundled_config_files
from jaxtrain.training.config import load_experiment, parse_gin
from jaxtrain.models.family import FamilyConfig, Runtime, _FAMILIES, families, family_of, model_family
from jaxtrain.models.layers.attention_impl import BlockwiseAttention, MaterializedAttention
from jaxtrain.models.llama import LlamaConfig, build_llama

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".gin"))

# What `gin.config_str()` wrote into <workdir>/config.gin for a DeepSeek run at commit ad84f9a,
# before the family records (with a part of every kind bound: router, rope scaling, attention
# strategy, context settings, non-finite policy). Kept verbatim: it must load as it did.
SAVED_BEFORE_RECORDS = """
ContextParallel.kv_exchange = @AllGatherKV()
ContextParallel.layout = @Contiguous()
DataConfig.eval_files = ['data/tiny_corpus/valid.txt']
DataConfig.tokenizer = 'bytes'
DataConfig.train_files = ['data/tiny_corpus/train.txt']
DeepSeekConfig.attention = @BlockwiseAttention()
DeepSeekConfig.embed = 128
DeepSeekConfig.expert_mlp = 64
DeepSeekConfig.first_k_dense = 1
DeepSeekConfig.heads = 4
DeepSeekConfig.kv_lora_rank = 64
DeepSeekConfig.layers = 4
DeepSeekConfig.mlp = 384
DeepSeekConfig.q_lora_rank = None
DeepSeekConfig.qk_nope_head_dim = 32
DeepSeekConfig.qk_rope_head_dim = 16
DeepSeekConfig.remat = 'full'
DeepSeekConfig.rope_scaling = @YarnScaling()
DeepSeekConfig.router = @RouterConfig()
DeepSeekConfig.shared_experts = 2
DeepSeekConfig.v_head_dim = 32
DeepSeekConfig.vocab_size = 320
Experiment.model = @DeepSeekConfig()
MeshConfig.context = 2
MeshConfig.data = 4
MeshConfig.tensor = 2
OptimizerConfig.learning_rate = 0.002
RouterConfig.aux_loss_weight = 0.001
RouterConfig.n_group = 4
RouterConfig.num_experts = 16
RouterConfig.top_k = 4
RouterConfig.topk_group = 2
TrainConfig.checkpoint_every = 100
TrainConfig.context_parallel = @ContextParallel()
TrainConfig.global_batch = 16
TrainConfig.nonfinite = @Rollback()
TrainConfig.rules = 'dp+experts_folded'
TrainConfig.seq_len = 128
TrainConfig.steps = 100
YarnScaling.factor = 4.0
YarnScaling.original_max_position = 64
"""


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _experiment_from(text: str):
    gin.clear_config()
    parse_gin([], [])  # the search path for bundled includes
    gin.parse_config(text)
    return load_experiment()


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_config_loads_and_survives_the_saved_config_gin(name, clean_gin):
    """Each configs/*.gin loads; the text a run saves as config.gin (gin.config_str()) loads back
    to an equal experiment."""
    parse_gin(bundled_config_files(name), [])
    exp = load_experiment()
    saved = gin.config_str()
    assert _experiment_from(saved) == exp


def test_a_config_gin_saved_before_the_family_records_still_loads(clean_gin):
    from jaxtrain.resilience.nonfinite import Rollback
    from jaxtrain.meshes.context_layout import AllGatherKV, Contiguous
    from jaxtrain.models.deepseek import DeepSeekConfig
    from jaxtrain.models.layers.rope import YarnScaling

    exp = _experiment_from(SAVED_BEFORE_RECORDS)
    model = exp.model
    assert isinstance(model, DeepSeekConfig) and model.router.num_experts == 16 and model.router.n_group == 4
    assert model.runtime() == Runtime(remat="full", attention=BlockwiseAttention(), kernels="xla")
    assert isinstance(model.rope_scaling, YarnScaling) and model.rope_scaling.factor == 4.0
    parts = [getattr(exp, f.name) for f in dataclasses.fields(exp)]  # wherever a setting lives now
    values = [getattr(p, f.name) for p in parts if dataclasses.is_dataclass(p) for f in dataclasses.fields(p)]
    assert any(isinstance(v, Rollback) for v in values), "the non-finite policy of the saved config is lost"
    context = next(v for v in values if type(v).__name__ == "ContextParallel")
    assert isinstance(context.layout, Contiguous) and isinstance(context.kv_exchange, AllGatherKV)


def test_each_family_registers_its_own_parts_with_gin(clean_gin):
    """No central list: a part named only by a new family's record is usable from gin."""
    @dataclasses.dataclass(frozen=True)
    class TinyPart:
        width: int = 1

    @model_family("tiny_parts_family", "a Llama with a part of its own", parts=(TinyPart,))
    @dataclasses.dataclass(frozen=True)
    class TinyPartsConfig(LlamaConfig):
        part: object = TinyPart()

        def build(self, rngs):
            return build_llama(self, rngs)

    try:
        gin.parse_config("TinyPartsConfig.part = @TinyPart()\nTinyPart.width = 7")
        built = gin.get_configurable("models.TinyPartsConfig")()
        assert built.part.width == 7 and family_of(built).name == "tiny_parts_family"
    finally:
        _FAMILIES.pop("tiny_parts_family")
    for family in families().values():
        for part in (family.config_class, *family.parts):
            assert gin.get_configurable(f"models.{part.__name__}") is not None, (family.name, part)


def test_the_hf_registry_is_a_view_of_the_family_records():
    adapters = {info.name: importlib.import_module(f"{hf_families_pkg.__name__}.{info.name}").FAMILY
                for info in pkgutil.iter_modules(hf_families_pkg.__path__)
                if hasattr(importlib.import_module(f"{hf_families_pkg.__name__}.{info.name}"), "FAMILY")}
    named = [family.hf_adapter.rsplit(".", 1)[-1] for family in families().values() if family.hf_adapter]
    assert sorted(named) == sorted(adapters), "every HF adapter module is named by exactly one family record"
    assert hf_registry.families() == {a.model_type: a for a in adapters.values()}
    for family in families().values():
        config = family.config_class()
        assert hf_registry.family_for_config(config) is family.hf() is adapters[family.hf_adapter.rsplit(".", 1)[-1]]
        assert family.hf().config_class is family.config_class


@pytest.mark.parametrize("name", ["llama", "deepseek_v2", "mamba2", "nemotron_h"])
def test_runtime_settings_go_through_the_protocol(name):
    family = families()[name]
    config = family.config_class()
    assert isinstance(config, FamilyConfig)
    runtime = config.runtime()
    assert runtime.remat == config.remat
    assert (runtime.attention is not None) == ("attention" in family.runtime_knobs)
    assert (runtime.kernels is not None) == ("kernels" in family.runtime_knobs)
    assert config.with_runtime() is config  # nothing asked, nothing changed

    changed = config.with_runtime(remat="full", kernels="pallas" if runtime.kernels else None,
                                  attention=MaterializedAttention() if runtime.attention else None)
    assert changed.runtime() == dataclasses.replace(
        runtime, remat="full", kernels="pallas" if runtime.kernels else None,
        attention=MaterializedAttention() if runtime.attention else None)
    # what the model computes is untouched
    others = [f.name for f in dataclasses.fields(config) if f.name not in family.runtime_knobs]
    assert all(getattr(changed, f) == getattr(config, f) for f in others)
    assert changed.param_count() == config.param_count()

    absent = [k for k in ("attention", "kernels") if k not in family.runtime_knobs]
    for knob in absent:
        value = MaterializedAttention() if knob == "attention" else "xla"
        with pytest.raises(ValueError, match=f"{family.config_class.__name__} has no {knob} setting"):
            config.with_runtime(**{knob: value})
