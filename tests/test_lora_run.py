"""A LoRA run end to end: started on a base converted from a transformers model (its first loss
is the base's, by transformers), checkpoints that hold the adapters alone on a recorded base, a
resume onto another layout equal to an uninterrupted run, a resume on another base refused, and
the adapters exported for peft (and merged for transformers) giving our logits."""
from __future__ import annotations

import json
import os
import shutil

import gin
import jax
import numpy as np
import pytest

from helpers import assert_finite, torch_loss, transformers_loss
from hf_tiny_models import save_tiny_llama
from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.cli import convert
from jaxtrain.data.packing import DataConfig, make_train_iterator
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.lora import LoraConfig

pytestmark = [pytest.mark.slow]

SEQ_LEN, BATCH, STEPS = 16, 8, 4
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
HF_CONFIG = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two converted base workdirs (different random weights) and a corpus."""
    root = tmp_path_factory.mktemp("lora_run")
    out = {}
    for name, seed in (("base", 3), ("other", 4)):
        hf_dir = save_tiny_llama(root / f"hf_{name}", seed=seed, **HF_CONFIG)
        assert convert.main([f"--hf_dir={hf_dir}", f"--workdir={root / name}"]) == 0
        out[name] = (hf_dir, root / name)
    text = " ".join(f"word{i % 89} and more" for i in range(1500))
    (root / "train.txt").write_text(text)
    return root, out


def _model(workdir):
    try:
        return convert.model_config_from_gin([str(workdir / "config.gin")])
    finally:
        gin.clear_config()


def _experiment(root, model, mesh: MeshConfig, base=None, steps=STEPS, rules="dp") -> Experiment:
    return Experiment(model=model, lora=LORA, lora_base=None if base is None else str(base), mesh=mesh,
                      data=DataConfig(train_files=(str(root / "train.txt"),), eval_files=()),
                      train=TrainConfig(steps=steps, global_batch=BATCH, seq_len=SEQ_LEN, rules=rules),
                      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay="constant"),
                      checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                      observe=ObserveConfig(eval_every=0, log_every=1))


@pytest.fixture(scope="module")
def straight(bases, tmp_path_factory):
    """STEPS uninterrupted on data=4 x tensor=2, on the base workdir named by Experiment.lora_base."""
    root, b = bases
    workdir = tmp_path_factory.mktemp("straight")
    exp = _experiment(root, _model(b["base"][1]), MeshConfig(data=8, tensor=2), base=b["base"][1])
    history = Trainer(exp, str(workdir)).run()
    losses = [h["loss"] for h in history]
    assert_finite(losses, "LoRA losses")
    return workdir, losses, exp


def test_starts_on_the_base_with_its_loss(bases, straight):
    """Fresh adapters (B = 0) on the converted base: the first loss is the transformers model's."""
    root, b = bases
    _, losses, exp = straight
    batch = next(make_train_iterator(exp.data, seq_len=SEQ_LEN, global_batch=BATCH, seed=exp.train.seed))
    assert losses[0] == pytest.approx(transformers_loss(b["base"][0], batch), rel=1e-5)
    assert losses[-1] < losses[0]  # the adapters train


def test_checkpoint_holds_adapters_on_a_recorded_base(bases, straight):
    root, b = bases
    workdir, _, _ = straight
    checkpointer = Checkpointer(str(workdir / "checkpoints"))
    try:
        step = checkpointer.latest_step()
        manifest = checkpointer.manifest(step)
        params, opt = checkpointer.saved_shapes(step), checkpointer.saved_shapes(step, "opt_state")
    finally:
        checkpointer.close()
    assert step == STEPS and sorted(manifest["items"]) == ["data", "opt_state", "params"]
    assert params and all("/adapter/" in p for p in params), [p for p in params if "/adapter/" not in p]
    arrays = [p for p, shape in opt.items() if len(shape) > 0]
    assert arrays and all("/adapter/" in p for p in arrays)
    base = manifest["base"]
    assert base["directory"] == str(b["base"][1] / "checkpoints") and base["step"] == 0 and base["fingerprint"]
    # the base's arrays are not in the run's checkpoint: what it saved is a small part of the base
    # (counted from the saved arrays' shapes: the bytes Orbax writes around them vary between saves)
    base_checkpointer = Checkpointer(str(b["base"][1] / "checkpoints"), keep=None, async_save=False)
    try:
        base_shapes = base_checkpointer.saved_shapes(0)
    finally:
        base_checkpointer.close()
    count = lambda shapes: sum(int(np.prod(shape)) for shape in shapes.values())
    assert 0 < count(params) < 0.2 * count(base_shapes), (count(params), count(base_shapes))


def test_resume_on_another_layout_equals_uninterrupted(bases, straight, tmp_path):
    root, b = bases
    _, losses, _ = straight
    model = _model(b["base"][1])
    first = Trainer(_experiment(root, model, MeshConfig(data=8, tensor=2), base=b["base"][1]), str(tmp_path))
    head = [h["loss"] for h in first.run(stop_after=STEPS // 2)]
    resumed = Trainer(_experiment(root, model, MeshConfig(data=4, tensor=2, expert=2), base=b["base"][1],
                                  rules="fsdp"), str(tmp_path))
    tail = [h["loss"] for h in resumed.run()]
    assert_finite(head + tail, "interrupted losses")
    np.testing.assert_allclose(head + tail, losses, rtol=2e-5)


def _cli_train(workdir, *extra, steps=2):
    from jaxtrain.cli import train

    args = [f"--gin_file={workdir / 'config.gin'}", f"--gin_file={os.path.join(REPO, 'configs', 'lora.gin')}",
            f"--workdir={workdir}", f"--gin_param=DataConfig.train_files=[{str(workdir.parent / 'train.txt')!r}]",
            "--gin_param=DataConfig.eval_files=[]", f"--gin_param=TrainConfig.steps={steps}",
            f"--gin_param=TrainConfig.global_batch={BATCH}", f"--gin_param=TrainConfig.seq_len={SEQ_LEN}",
            "--gin_param=MeshConfig.data=8", "--gin_param=MeshConfig.tensor=2",
            "--gin_param=LoraConfig.rank=4",
            "--gin_param=OptimizerConfig.learning_rate=1e-2", "--gin_param=OptimizerConfig.warmup_steps=0",
            "--gin_param=CheckpointConfig.checkpoint_every=1", "--gin_param=CheckpointConfig.keep_checkpoints=1",
            "--gin_param=CheckpointConfig.async_checkpoint=False", "--gin_param=ObserveConfig.eval_every=0",
            *extra]
    try:
        return train.main(args)
    finally:
        gin.clear_config()


@pytest.fixture(scope="module")
def cli_run(bases, tmp_path_factory):
    """`python -m jaxtrain.train --gin_file=W/config.gin --gin_file=configs/lora.gin` in the converted
    workdir W itself, 2 steps, a checkpoint each step (one kept)."""
    root, b = bases
    workdir = root / "cli"
    shutil.copytree(b["base"][1], workdir)
    assert _cli_train(workdir) == 0
    return workdir


def test_cli_run_in_the_base_workdir_keeps_the_base(cli_run, capsys):
    steps = sorted(int(d) for d in os.listdir(cli_run / "checkpoints") if d.isdigit())
    assert steps == [0, 2]  # the base outlives the rotation of adapter steps
    saved = json.loads((cli_run / "checkpoints" / "2" / "_CHECKPOINT_METADATA").read_text())
    assert saved["custom_metadata"]["jaxtrain"]["base"]["directory"] == str(cli_run / "checkpoints")
    assert "LoraConfig.rank = 4" in (cli_run / "config.gin").read_text()


def test_cli_start_line_names_trained_parameters(bases, tmp_path, capsys):
    root, b = bases
    workdir = root / "cli_line"
    shutil.copytree(b["base"][1], workdir)
    assert _cli_train(workdir, steps=1) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "M params" in x)
    # rank 4 x 2 layers x (in + out) of q, k, v (2 kv heads of 8), o, gate, up, down
    adapters = 4 * 2 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 3 * (32 + 64))
    assert f"of which {adapters / 1e6:.4f}M trained" in line, line


def test_resume_on_another_base_is_refused(bases, cli_run, capsys):
    """The adapters were trained on `base`: resuming with Experiment.lora_base = `other` is exit 2,
    one line naming both bases, and nothing is written."""
    root, b = bases
    before = sorted(os.listdir(cli_run / "checkpoints"))
    config = (cli_run / "config.gin").read_text()
    code = None
    with pytest.raises(SystemExit) as exited:
        code = _cli_train(cli_run, f"--gin_param=Experiment.lora_base={str(b['other'][1])!r}", steps=3)
    code = exited.value.code if code is None else code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and str(cli_run / "checkpoints") in err[0] and str(b["other"][1] / "checkpoints") in err[0], err
    assert sorted(os.listdir(cli_run / "checkpoints")) == before and (cli_run / "config.gin").read_text() == config


def _ours_logits(workdir, tokens):
    """The LoRA run's model (adapters unmerged) on `tokens`, from its latest checkpoint."""
    from jaxtrain.generate.loading import canonical_model

    config, checkpoints, step = convert._lora_run(str(workdir), None, (), (), "read")
    params, _ = convert._read_params(config, checkpoints, step, adapters_only=False)
    gin.clear_config()
    return np.asarray(canonical_model(config, params)(tokens))


def _torch_logits(model, tokens):
    import torch
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def test_adapter_export_loads_in_peft_with_our_logits(bases, cli_run, tmp_path):
    import peft
    import torch
    import transformers

    root, b = bases
    out = tmp_path / "adapter"
    assert convert.main([f"--workdir={cli_run}", f"--hf_adapter_out={out}", f"--hf_base={b['base'][0]}"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 16.0)
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"])
    tokens = np.random.default_rng(11).integers(0, 320, (2, 12)).astype(np.int32)
    base = transformers.AutoModelForCausalLM.from_pretrained(b["base"][0], dtype=torch.float32).eval()
    theirs_base = _torch_logits(base, tokens)
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 7 and all(p.abs().max() > 0 for p in lora_b)  # every adapter loaded, trained
    ours, theirs = _ours_logits(cli_run, tokens), _torch_logits(model, tokens)
    assert_finite(ours)
    assert np.abs(theirs - theirs_base).max() > 1e-3  # the adapters change the logits
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_merged_export_equals_the_unmerged_model(cli_run, tmp_path):
    import torch
    import transformers

    out = tmp_path / "merged"
    assert convert.main([f"--workdir={cli_run}", f"--hf_out={out}", "--merge_adapters"]) == 0
    tokens = np.random.default_rng(12).integers(0, 320, (2, 12)).astype(np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    np.testing.assert_allclose(_ours_logits(cli_run, tokens), _torch_logits(model, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [["--hf_adapter_out={out}"], ["--hf_out={out}", "--merge_adapters"]])
def test_adapter_export_from_a_run_without_adapters_is_refused(bases, tmp_path, capsys, flags):
    root, b = bases
    out = tmp_path / "out"
    code = convert.main([f"--workdir={b['base'][1]}", *(f.format(out=out) for f in flags)])
    gin.clear_config()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is not a LoRA run" in err[0], err
    assert not out.exists()


def test_generate_on_a_lora_run_uses_the_adapters(cli_run, tmp_path, capsys):
    """`python -m jaxtrain.generate --workdir W` greedy tokens equal the merged model's greedy
    tokens by transformers (which the base alone does not give)."""
    import torch
    import transformers

    from jaxtrain.cli import generate
    from jaxtrain.data.tokenizer import load_tokenizer

    prompts = ["word1 and more word", "word7"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    capsys.readouterr()
    try:
        assert generate.main([f"--workdir={cli_run}", f"--prompts={tmp_path / 'prompts.jsonl'}",
                              "--max_new_tokens=6"]) == 0
    finally:
        gin.clear_config()
    got = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert convert.main([f"--workdir={cli_run}", f"--hf_out={tmp_path / 'merged'}", "--merge_adapters"]) == 0
    gin.clear_config()
    tokenizer = load_tokenizer("bytes")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = list(tokenizer.encode(prompt))
        want = []
        for _ in range(6):
            nxt = int(_torch_logits(model, np.array([ids + want]))[0, -1].argmax())
            want.append(nxt)
            if nxt == tokenizer.eos_id:
                break
        assert tokens == want, (prompt, tokens, want)


def test_a_peft_adapter_imports_and_trains_on(bases, tmp_path):
    """A peft adapter directory (peft's own save_pretrained, B nonzero) imported onto its converted
    base: our model gives peft's logits, and training the imported workdir starts from peft's loss."""
    import peft
    import torch
    import transformers

    from jaxtrain.cli import train

    root, b = bases
    hf_dir, base_workdir = b["base"]
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    theirs = peft.get_peft_model(model, config).eval()
    theirs.save_pretrained(str(tmp_path / "adapter"))
    workdir = tmp_path / "imported"
    code = convert.main([f"--hf_adapter_dir={tmp_path / 'adapter'}", f"--lora_base={base_workdir}",
                         f"--workdir={workdir}"])
    gin.clear_config()
    assert code == 0
    assert "LoraConfig.targets = ('q', 'v', 'down')" in (workdir / "config.gin").read_text()
    tokens = np.random.default_rng(13).integers(0, 320, (2, 12)).astype(np.int32)
    ours = _ours_logits(workdir, tokens)
    assert_finite(ours)
    np.testing.assert_allclose(ours, _torch_logits(theirs, tokens), rtol=1e-5, atol=1e-5)

    (workdir.parent / "train.txt").write_text((root / "train.txt").read_text())
    try:
        assert train.main([f"--gin_file={workdir / 'config.gin'}", f"--workdir={workdir}",
                           f"--gin_param=DataConfig.train_files=[{str(workdir.parent / 'train.txt')!r}]",
                           "--gin_param=DataConfig.eval_files=[]", "--gin_param=TrainConfig.steps=2",
                           f"--gin_param=TrainConfig.global_batch={BATCH}", f"--gin_param=TrainConfig.seq_len={SEQ_LEN}",
                           "--gin_param=MeshConfig.data=8", "--gin_param=MeshConfig.tensor=2",
                           "--gin_param=CheckpointConfig.async_checkpoint=False",
                           "--gin_param=ObserveConfig.eval_every=0"]) == 0
        data = DataConfig(train_files=(str(workdir.parent / "train.txt"),), eval_files=())
        batch = next(make_train_iterator(data, seq_len=SEQ_LEN, global_batch=BATCH, seed=TrainConfig().seed))
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first = next(r["loss"] for r in rows if r["kind"] == "train" and r["step"] == 1)
    assert first == pytest.approx(torch_loss(theirs, batch), rel=1e-5)
    assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())[-1] == 2


def test_a_peft_adapter_on_a_module_we_cannot_place_is_refused(bases, tmp_path, capsys):
    """An adapter on a module outside the family's targets (here the LM head) is exit 2, one line
    naming it, and nothing is written."""
    import peft
    import torch
    import transformers

    root, b = bases
    hf_dir, base_workdir = b["base"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])).save_pretrained(
        str(tmp_path / "adapter"))
    capsys.readouterr()
    code = convert.main([f"--hf_adapter_dir={tmp_path / 'adapter'}", f"--lora_base={base_workdir}",
                         f"--workdir={tmp_path / 'imported'}"])
    gin.clear_config()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lm_head" in err[0], err
    assert not (tmp_path / "imported").exists()
