"""The train CLI end to end, and its errors on bad input."""
import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from jaxtrain.cli import train
from helpers import bundled_config_files
from processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [  # keep compiles small; the default config's own size is exercised by `make train`
    "--gin_param=LlamaConfig.embed=32", "--gin_param=LlamaConfig.layers=2", "--gin_param=LlamaConfig.mlp=64",
    "--gin_param=LlamaConfig.heads=4", "--gin_param=LlamaConfig.kv_heads=2",
    "--gin_param=TrainConfig.seq_len=32", "--gin_param=ObserveConfig.eval_batches=1",
]


# greedy samples during training, at the last step: the generate CLI's test reproduces them
SAMPLES = ["--gin_param=ObserveConfig.sample_every=3", "--gin_param=ObserveConfig.sample_tokens=6",
           "--gin_param=ObserveConfig.sample_prompts=('A paragraph', 'Heading =')"]


def run_cli(args, xla_flags=""):
    env = child_env(xla_flags)
    return subprocess.run([sys.executable, "-m", "jaxtrain.cli.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli") / "run"
    proc = run_cli([f"--workdir={workdir}", "--gin_param=TrainConfig.steps=3", *TINY, *SAMPLES])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


def test_default_config_trains_end_to_end(trained):
    workdir, proc = trained
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["tokens_per_sec"] > 0 for r in train_rows)
    assert any(r["kind"] == "eval" and r["perplexity"] > 1 for r in rows)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tensorboard"))
    assert (workdir / "checkpoints" / "3" / "params").is_dir()
    assert "mesh pipeline=1 x data=4" in proc.stdout  # the default simulates 8 CPU devices


def in_process(args, capsys):
    """Runs the CLI in this process (16 simulated devices: the mesh is data=8 x tensor=2)."""
    args = [args[0], "--gin_param=MeshConfig.data=8", *args[1:]]
    gin.clear_config()
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    gin.clear_config()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("bindings, message", [
    (["DataConfig.train_files=['no/such/file.txt']"], "no/such/file.txt"),
    # the rule tables' check over every parameter names the first one of each cause
    (["LlamaConfig.heads=6", "LlamaConfig.kv_heads=3", "LlamaConfig.head_dim=8"],
     "kv_heads=3 is not divisible by tensor=2: parameter stacks/blocks/layers/attn/k/kernel of shape"),
    (["LlamaConfig.heads=6", "LlamaConfig.kv_heads=2", "LlamaConfig.head_dim=8", "MeshConfig.data=4",
      "MeshConfig.tensor=4"],
     "heads=6 is not divisible by tensor=4: parameter stacks/blocks/layers/attn/o/kernel of shape"),
    (["LlamaConfig.heads=8", "LlamaConfig.embed=40"], "head_dim=5 must be even"),
    (["TrainConfig.steps=0"], "TrainConfig.steps must be positive"),
    (["TrainConfig.global_batch=-8"], "TrainConfig.global_batch must be positive"),
    (["ObserveConfig.sample_every=2"], "ObserveConfig.sample_every is set but sample_prompts is empty"),
    # samples during training on a context-parallel layout: refused at start, not at the first sample
    (["ObserveConfig.sample_every=2", "ObserveConfig.sample_prompts=('A',)", "MeshConfig.data=4",
      "MeshConfig.context=2"], "generation does not run under context parallelism (context=2"),
    (["TrainConfig.nonexistent=3"], "nonexistent"),
    (["MeshConfig.data=2"], "needs 4 devices but 16 are available"),
    (["TrainConfig.global_batch=6"], "not divisible by the data-parallel size 8"),
    # context parallelism: the load-balanced order needs 2 x context chunks
    (["MeshConfig.data=4", "MeshConfig.context=2", "TrainConfig.seq_len=34"],
     "TrainConfig.seq_len=34: sequence length 34 is not divisible by context=2 x 2 chunks per rank"),
    (["LlamaConfig.attention='flash'"], "LlamaConfig.attention must be one of MaterializedAttention()"),
    (["LlamaConfig.attention=@PallasAttention()"], "PallasAttention needs a GPU"),
    # the byte tokenizer emits 259 ids: a smaller table would embed the last ones as NaN
    (["LlamaConfig.vocab_size=257"], "LlamaConfig.vocab_size=257 is smaller than the 259 token ids"),
    (["TrainConfig.steps=1.5"], "TrainConfig.steps must be int, got 1.5 (float)"),
    (["TrainConfig.steps='ten'"], "TrainConfig.steps must be int, got 'ten' (str)"),
    (["OptimizerConfig.learning_rate='fast'"], "OptimizerConfig.learning_rate must be float, got 'fast'"),
    (["LlamaConfig.layers=None"], "LlamaConfig.layers must be int, got None"),
    (["ResilienceConfig.nonfinite='skip'"], "ResilienceConfig.nonfinite must be @Halt(), @Skip() or @Rollback()"),
    (["CheckpointConfig.reset_on_resume=('params',)"], "CheckpointConfig.reset_on_resume may hold 'opt_state' and 'data'"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, bindings, message):
    workdir = tmp_path / "run"
    code, err = in_process([f"--workdir={workdir}", *TINY, *[f"--gin_param={b}" for b in bindings]], capsys)
    assert code == 2  # the README's promise for bad input
    assert message in err, err
    assert err.strip().startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (workdir / "checkpoints").exists() and not (workdir / "config.gin").exists()


def test_empty_corpus_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    code, err = in_process([f"--workdir={tmp_path / 'run'}", *TINY, f"--gin_param=DataConfig.train_files=['{empty}']"],
                           capsys)
    assert code == 2 and "empty corpus" in err and str(empty) in err


def test_mesh_not_matching_devices_exits_nonzero_from_a_real_process(tmp_path):
    proc = run_cli([f"--workdir={tmp_path / 'run'}", *TINY],
                   xla_flags="--xla_force_host_platform_device_count=6")
    assert proc.returncode == 2
    assert "needs 8 devices but 6 are available" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_eval_cli_scores_a_raw_text_file(trained, tmp_path):
    workdir, _ = trained
    text = tmp_path / "wiki.test.raw"
    text.write_text(" = Heading = \n\n A paragraph of text , with WikiText spacing .\n\n" * 20)
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.cli.eval", f"--workdir={workdir}", f"--data={text}",
                           "--stride=8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checkpoint_step"] == 3
    assert result["tokens"] == len(text.read_bytes()) - 1  # byte tokens: every byte after the first
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]))


BUNDLED = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".gin"))
LOAD_ALL = """
import sys, gin
from jaxtrain.training.config import load_experiment, parse_gin
for files in sys.argv[1:]:  # each: a run's gin files, comma-joined
    gin.clear_config()
    parse_gin(files.split(","), [])
    exp = load_experiment()
    assert exp.model is not None and exp.train.steps > 0
    print("loaded", files)
"""


def test_every_bundled_config_loads_from_any_working_directory(tmp_path):
    """As a user runs them: from another directory, the repo not on sys.path (only installed), so
    includes like 'configs/default.gin' must resolve without the working directory's help."""
    env = child_env(drop=("PYTHONPATH",))
    paths = [",".join(bundled_config_files(name)) for name in BUNDLED]
    proc = subprocess.run([sys.executable, "-c", LOAD_ALL, *paths], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("loaded") == len(BUNDLED) >= 10


def test_generate_cli_from_a_workdir_on_two_layouts(trained, tmp_path):
    """The newest checkpoint restored as eval restores it; the run's layout (data=8) and one device
    give the same greedy tokens, and the text printed is those tokens decoded."""
    workdir, _ = trained
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "A paragraph"}) + "\n" + json.dumps("Heading =") + "\n")
    outputs = []
    for layout in ([], ["--layout=data=1"]):
        proc = subprocess.run([sys.executable, "-m", "jaxtrain.generate", f"--workdir={workdir}",
                               f"--prompts={prompts}", "--max_new_tokens=6", *layout],
                              cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append([json.loads(line) for line in proc.stdout.strip().splitlines()])
    assert outputs[0] == outputs[1]
    # the samples written while training (step 3: the checkpoint's parameters) are the same text
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in rows if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [3]
    assert samples[0]["samples"] == [{"prompt": o["prompt"], "text": o["text"]} for o in outputs[0]]
    events = b"".join(p.read_bytes() for p in (workdir / "tensorboard").iterdir())
    assert b"samples/0" in events and b"samples/1" in events  # TensorBoard's text tab
    from jaxtrain.data.tokenizer import ByteTokenizer
    for row in outputs[0]:
        assert 1 <= len(row["tokens"]) <= 6 and row["text"] == ByteTokenizer().decode(row["tokens"])
