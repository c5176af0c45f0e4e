"""jaxtrain as an lm-evaluation-harness backend, against the harness's own HF backend on the same
weights: tiny random transformers models of each family with a tokenizer, imported, scored on three
offline tasks shipped in tests/harness_tasks/ (multiple choice, rolling perplexity, generation with
stop sequences), on one device and on a 16-device layout with `tensor` and `expert`."""
from __future__ import annotations

import json
import math
import os

import gin
import jax
import numpy as np
import pytest

from hf_tiny_models import forward, save_tiny_deepseek_v2, save_tiny_llama, save_tiny_nemotron_h
from store_helpers import make_chat_tokenizer

pytestmark = [pytest.mark.slow]

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_tasks")
TASKS = ("jaxtrain_local_choice", "jaxtrain_local_rolling", "jaxtrain_local_generate")
MAX_LENGTH = 64  # short enough that the rolling task's documents take several windows
WORDS = ("the a river stone light cold market north winter bread song paper garden quiet engine silver road "
         "window question answer continue").split()
SAVERS = {"llama": save_tiny_llama, "deepseek_v2": save_tiny_deepseek_v2, "nemotron_h": save_tiny_nemotron_h}


@pytest.fixture(scope="module", autouse=True)
def in_tasks_dir():
    """The task YAMLs name their jsonl files relative to their folder."""
    before = os.getcwd()
    os.chdir(TASKS_DIR)
    yield
    os.chdir(before)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{family: a tiny random HF model directory with a byte-level BPE tokenizer}."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 12)) + "." for _ in range(200)]
    dirs = {}
    for family, save in SAVERS.items():
        directory = tmp_path_factory.mktemp(family)
        save(directory, seed=5, vocab_size=320, max_position_embeddings=MAX_LENGTH)
        make_chat_tokenizer(directory, texts, vocab_size=300)
        dirs[family] = str(directory)
    return dirs


@pytest.fixture(scope="module")
def manager():
    from jaxtrain.harness.tasks import TaskRequest, task_manager

    return task_manager(TaskRequest(TASKS, include_path=TASKS_DIR))


def evaluate(lm, manager, tasks=TASKS):
    from jaxtrain.harness.tasks import TaskRequest, evaluate as run

    return run(lm, TaskRequest(tuple(tasks), include_path=TASKS_DIR, log_samples=True), manager)


_HF_RESULTS = {}


def hf_results(family, hf_dir, manager):
    """The harness's HF backend on `hf_dir` (float32, CPU), computed once per family."""
    if family not in _HF_RESULTS:
        from lm_eval.models.huggingface import HFLM

        _HF_RESULTS[family] = evaluate(HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=4,
                                            max_length=MAX_LENGTH), manager)
    return _HF_RESULTS[family]


def responses(results, task):
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_scores(ours, theirs):
    """Every request's log-likelihood within 1e-4, greedy flags and generated text identical, and
    the aggregate metrics equal."""
    for task in TASKS:
        mine, ref = responses(ours, task), responses(theirs, task)
        assert len(mine) == len(ref) > 0, task
        for doc_mine, doc_ref in zip(mine, ref):
            for a, b in zip(doc_mine, doc_ref):
                a, b = a[0], b[0]
                if task == "jaxtrain_local_generate":
                    assert a == b
                elif task == "jaxtrain_local_rolling":
                    assert math.isfinite(a) and abs(a - b) <= 1e-4, (a, b)
                else:
                    assert math.isfinite(a[0]) and abs(a[0] - b[0]) <= 1e-4, (a, b)
                    assert a[1] == b[1]
        for metric, value in theirs["results"].get(task, {}).items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-6, abs=1e-9), (task, metric)


# DeepSeek-V2 and Nemotron-H on one device, and the 16-device layouts, run in `make test-extended`
# (the suite's budget); in the suite, the CLI test holds Nemotron-H to the HF backend on three
# documents of each task and the forward-pass test DeepSeek-V2's scores to its own float64 logits.
@pytest.mark.parametrize("family,layout", [
    ("llama", None),
    pytest.param("deepseek_v2", None, marks=pytest.mark.extended),
    pytest.param("nemotron_h", None, marks=pytest.mark.extended),
    pytest.param("deepseek_v2", "data=2,expert=4,tensor=2", marks=pytest.mark.extended),
    pytest.param("llama", "data=4,tensor=4", marks=pytest.mark.extended),
    pytest.param("nemotron_h", "data=2,expert=4,tensor=2", marks=pytest.mark.extended),
])
def test_scores_equal_the_harness_hf_backend(hf_dirs, manager, family, layout):
    from jaxtrain.harness.lm import JaxtrainLM

    ours = evaluate(JaxtrainLM(hf_dir=hf_dirs[family], layout=layout, batch_size=4, max_length=MAX_LENGTH),
                    manager)
    assert_same_scores(ours, hf_results(family, hf_dirs[family], manager))


def test_chat_templated_prompts_equal_the_hf_backend(hf_dirs, manager):
    """apply_chat_template: the few-shot prompt rendered by the tokenizer's chat template, as the HF
    backend renders it, and scored alike."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from jaxtrain.harness.lm import JaxtrainLM

    task = ["jaxtrain_local_choice"]
    runs = [lm_eval.simple_evaluate(model=lm, tasks=task, task_manager=manager, log_samples=True, limit=4,
                                    apply_chat_template=True, num_fewshot=1)
            for lm in (JaxtrainLM(hf_dir=hf_dirs["llama"], batch_size=4, max_length=MAX_LENGTH),
                       HFLM(pretrained=hf_dirs["llama"], dtype="float32", device="cpu", batch_size=4,
                            max_length=MAX_LENGTH))]
    ours, theirs = ([s["arguments"] for s in r["samples"][task[0]]] for r in runs)
    assert ours == theirs and "<|im_start|>" in ours[0][0][0]  # the template's own markers
    for a, b in zip(responses(runs[0], task[0]), responses(runs[1], task[0])):
        assert all(math.isfinite(r[0][0]) for r in a)
        np.testing.assert_allclose([r[0][0] for r in a], [r[0][0] for r in b], atol=1e-4)


def test_greedy_continuations_are_flagged_greedy(hf_dirs):
    """Continuations the model would generate itself are greedy in both backends, one token off is not."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from jaxtrain.harness.lm import JaxtrainLM

    ours = JaxtrainLM(hf_dir=hf_dirs["llama"], batch_size=4, max_length=MAX_LENGTH)
    theirs = HFLM(pretrained=hf_dirs["llama"], dtype="float32", device="cpu", batch_size=4, max_length=MAX_LENGTH)
    contexts = ["the river stone", "north winter bread song", "a quiet", "cold market", "the paper garden",
                "silver road window", "light", "song paper"]
    greedy = ours.engine().generate([ours.tok_encode(c) for c in contexts], max_new_tokens=4)
    requests, expected = [], []
    for context, tokens in zip(contexts, greedy):
        whole = ours.tok_decode(ours.tok_encode(context) + tokens, skip_special_tokens=False)
        if ours.tok_encode(whole) != ours.tok_encode(context) + tokens:
            continue  # the text re-tokenizes otherwise: the harness would score other tokens
        requests.append(Instance("loglikelihood", {}, (context, whole[len(context):]), len(requests)))
        expected.append(True)
        wrong = ours.tok_decode(ours.tok_encode(context) + tokens[:-1] + [(tokens[-1] + 1) % 300],
                                skip_special_tokens=False)
        requests.append(Instance("loglikelihood", {}, (context, wrong[len(context):]), len(requests)))
        expected.append(False)
    assert expected.count(True) >= 2
    mine, ref = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert all(math.isfinite(lp) for lp, _ in mine)
    assert [flag for _, flag in mine] == [flag for _, flag in ref] == expected
    np.testing.assert_allclose([lp for lp, _ in mine], [lp for lp, _ in ref], atol=1e-4)

    # generate_until cuts at a stop sequence the text reaches mid-way, as the HF backend does
    free = ours.generate_until([Instance("generate_until", {}, (contexts[0], {"until": [], "max_gen_toks": 10}), 0)])[0]
    stop = free[len(free) // 2:len(free) // 2 + 2]
    request = [Instance("generate_until", {}, (contexts[0], {"until": [stop], "max_gen_toks": 10}), 0)]
    cut = ours.generate_until(request)
    assert cut == [free.split(stop)[0]] == theirs.generate_until(request) and len(cut[0]) < len(free)


def test_scores_equal_a_forward_pass_one_request_at_a_time(hf_dirs):
    """120 requests of varied lengths, half of them multiple-choice groups sharing a context: each
    request's score equals a float64 log-softmax of the model's own logits on that request alone,
    unpadded; one compile per program (length bucket x scored-tail bucket) the scorer ran."""
    from jaxtrain import hf
    from jaxtrain.generate.compiles import count_compiles
    from jaxtrain.harness.scoring import TokenScorer

    model = hf.load(hf_dirs["deepseek_v2"])  # routed experts: padding rows must not change a request's routing
    scorer = TokenScorer(model, batch_size=32)
    rng = np.random.default_rng(1)
    requests = []
    while len(requests) < 120:
        context = rng.integers(0, 320, int(rng.integers(1, 110))).tolist()
        for _ in range(1 if len(requests) < 60 else int(rng.integers(2, 5))):  # alone, then choices
            requests.append((context + rng.integers(0, 320, int(rng.integers(1, 10))).tolist(),))
            requests[-1] = (requests[-1][0], len(requests[-1][0]) - len(context))
    with count_compiles() as compiles:
        scored = scorer.score(requests)
    kinds = {kind: {p for p in scorer.programs if p[0] == kind} for kind in ("whole", "prefill")}
    assert kinds["whole"] and kinds["prefill"] and len(scorer.programs) <= 12, scorer.programs
    assert compiles["_score_fn"] == len(kinds["whole"]) and compiles["_prefill_fn"] == len(kinds["prefill"])
    assert compiles["_step_fn"] <= len(kinds["prefill"]), dict(compiles)  # one per cache length
    for i in [*rng.choice(60, 3, replace=False), *rng.choice(range(60, len(requests)), 3, replace=False)]:
        tokens, n = requests[i]
        logits = forward(model, np.asarray([tokens[:-1]], np.int32))[0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        positions = np.arange(len(tokens) - 1 - n, len(tokens) - 1)
        targets = np.asarray(tokens[1:])[positions]
        assert scored[i].logprob == pytest.approx(logprobs[positions, targets].sum(), abs=1e-4), i
        assert scored[i].greedy == bool(np.all(logits[positions].argmax(-1) == targets))


@pytest.fixture(scope="module")
def workdir(hf_dirs, tmp_path_factory):
    """The llama directory converted to a training workdir (its tokenizer recorded in config.gin)."""
    from jaxtrain.cli import convert

    work = tmp_path_factory.mktemp("work")
    assert convert.main([f"--hf_dir={hf_dirs['llama']}", f"--workdir={work}"]) == 0
    with open(work / "config.gin", "a") as f:  # the length the run trains at: the harness's default max_length
        f.write(f"\nTrainConfig.seq_len = {MAX_LENGTH}\n")
    return str(work)


def test_rolling_loglikelihood_equals_the_perplexity_path(workdir, tmp_path, capsys):
    """A document's harness log-likelihood from the workdir equals `python -m jaxtrain.eval --data`
    on the same tokens (the BOS the harness conditions the first token on written in front), with
    windows that cut the document where the harness's do: one whole window, then two."""
    from jaxtrain.cli.eval import main as eval_main
    from jaxtrain.harness.lm import JaxtrainLM
    from lm_eval.api.instance import Instance

    def from_workdir(**kwargs):
        try:
            return JaxtrainLM(workdir=workdir, batch_size=2, **kwargs)
        finally:
            gin.clear_config()

    lm = from_workdir()
    assert lm.max_length == MAX_LENGTH  # the run's seq_len
    words = list(np.random.default_rng(2).choice(WORDS, 60))
    while len(lm.tok_encode(" ".join(words))) > 2 * 24:
        words.pop()
    if len(lm.tok_encode(" ".join(words))) % 2:
        words.pop()
    text = " ".join(words)
    n = len(lm.tok_encode(text))
    path = tmp_path / "doc.txt"
    path.write_text(lm.tok_decode([lm.prefix_token_id], skip_special_tokens=False) + text)
    for window in (n, n // 2):
        ours = from_workdir(max_length=window).loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
        try:
            assert eval_main(["--workdir", workdir, "--data", str(path), "--seq_len", str(window), "--stride",
                              str(window), "--batch_size", "16"]) == 0
        finally:
            gin.clear_config()
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["tokens"] == n
        assert ours == pytest.approx(-out["loss"] * out["tokens"], abs=1e-4)


def test_a_run_in_python_scores_as_its_checkpoint(hf_dirs, workdir):
    """`JaxtrainLM(run=...)`: a Run on data=2,tensor=2 holding the imported weights scores as the
    HF directory does on one device."""
    from flax import nnx

    from jaxtrain import hf
    from jaxtrain.api import Run
    from jaxtrain.harness.lm import JaxtrainLM
    from jaxtrain.training.config import TrainConfig
    from lm_eval.api.instance import Instance

    model = hf.load(hf_dirs["llama"])
    run = Run.create(model.config, "data=2,tensor=2", train=TrainConfig(seq_len=MAX_LENGTH, global_batch=2),
                     params=nnx.to_pure_dict(nnx.state(model)))
    from_run = JaxtrainLM(run=run, tokenizer=hf_dirs["llama"], batch_size=2)
    from_dir = JaxtrainLM(hf_dir=hf_dirs["llama"], batch_size=2)
    requests = [Instance("loglikelihood", {}, ("the river", " stone light"), 0),
                Instance("loglikelihood", {}, ("", "north winter"), 1)]
    run_scores = np.asarray(from_run.loglikelihood(requests), float)
    assert np.isfinite(run_scores).all()
    np.testing.assert_allclose(run_scores, np.asarray(from_dir.loglikelihood(requests), float), atol=1e-5)


def run_cli(capsys, *argv):
    from jaxtrain.cli.eval import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    finally:
        gin.clear_config()
    return code, capsys.readouterr()


def test_cli_prints_the_table_and_writes_the_harness_results(hf_dirs, manager, tmp_path, capsys):
    output = tmp_path / "out" / "results.json"
    code, out = run_cli(capsys, "--hf_dir", hf_dirs["nemotron_h"], "--tasks", ",".join(TASKS), "--include_path",
                        TASKS_DIR, "--limit", "3", "--batch_size", "4", "--max_length", str(MAX_LENGTH),
                        "--output", str(output), "--log_samples")
    assert code == 0, out.err
    assert all(task in out.out for task in TASKS) and "acc_norm" in out.out
    written = json.loads(output.read_text())
    reference = hf_results("nemotron_h", hf_dirs["nemotron_h"], manager)
    for task in TASKS:
        assert len(written["samples"][task]) == written["results"][task]["sample_len"] == 3
    trimmed = {"samples": {task: sorted(reference["samples"][task], key=lambda s: s["doc_id"])[:3] for task in TASKS},
               "results": {}}
    assert_same_scores(written, trimmed)  # the HF backend's responses, read back from the JSON
    assert written["configs"]["jaxtrain_local_generate"]["generation_kwargs"]["until"] == ["\n", "."]


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "no_such_task"], "unknown task(s) no_such_task"),
    (["--tasks", "jaxtrain_local_choice", "--limit", "0"], "limit must be > 0"),
    (["--tasks", "jaxtrain_local_choice", "--limit", "-3"], "limit must be > 0"),
    (["--tasks", "jaxtrain_local_generate", "--layout", "context=2"], "context parallelism"),
    (["--tasks", ""], "no tasks given"),
])
def test_bad_input_is_one_line_and_exit_2(hf_dirs, capsys, argv, message):
    code, out = run_cli(capsys, "--hf_dir", hf_dirs["llama"], "--include_path", TASKS_DIR, *argv)
    assert code == 2
    assert message in out.err and len(out.err.strip().splitlines()) == 1, out.err


def test_a_workdir_without_a_tokenizer_is_refused(tmp_path, capsys):
    from jaxtrain.cli import convert

    bare = save_tiny_llama(tmp_path / "bare", seed=1, vocab_size=320)
    assert convert.main([f"--hf_dir={bare}", f"--workdir={tmp_path / 'work'}"]) == 0
    gin.clear_config()
    capsys.readouterr()  # the conversion's own output
    code, out = run_cli(capsys, "--workdir", str(tmp_path / "work"), "--tasks", "jaxtrain_local_choice",
                        "--include_path", TASKS_DIR)
    assert code == 2 and "no Hugging Face tokenizer" in out.err and len(out.err.strip().splitlines()) == 1


def test_harness_model_args_carry_a_layout():
    from jaxtrain.cli.harness import _model_args

    args = _model_args(["run", "--model", "jaxtrain", "--model_args", "hf_dir=/x,layout=data=2:tensor=2",
                        "--tasks", "t"])
    assert args == {"hf_dir": "/x", "layout": "data=2:tensor=2"}
    assert _model_args(["--model_args=workdir=/w"]) == {"workdir": "/w"}


def test_task_scores_while_training_use_the_current_parameters(hf_dirs, workdir, tmp_path):
    """ObserveConfig.eval_tasks on data=2,tensor=2: scores at every eval step and at the end, the
    last equal to the harness scoring the saved final checkpoint on its own; the train step and each
    scoring program compiled once for the whole run."""
    import shutil

    from jaxtrain.cli import convert
    from jaxtrain.data.packing import DataConfig
    from jaxtrain.generate.compiles import count_compiles
    from jaxtrain.harness.lm import JaxtrainLM
    from jaxtrain.harness.tasks import TaskRequest, evaluate as run_tasks, scalar_scores
    from jaxtrain.harness.training import TrainingTaskEvaluator
    from jaxtrain.training.config import Experiment, TrainConfig
    from jaxtrain.training.optim import OptimizerConfig
    from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
    from jaxtrain.training.trainer import Trainer
    from jaxtrain.meshes.mesh import MeshConfig

    run_dir = tmp_path / "run"
    shutil.copytree(workdir, run_dir)
    try:
        model = convert.model_config_from_gin([str(run_dir / "config.gin")])
    finally:
        gin.clear_config()
    train_file = tmp_path / "train.txt"
    train_file.write_text(" ".join(np.random.default_rng(3).choice(WORDS, 3000)))
    tasks = ("jaxtrain_local_choice", "jaxtrain_local_rolling")  # generation during training: test_cli's samples
    exp = Experiment(model=model, mesh=MeshConfig(data=2, tensor=2),
                     data=DataConfig(train_files=(str(train_file),), eval_files=(), tokenizer=hf_dirs["llama"]),
                     train=TrainConfig(steps=4, global_batch=4, seq_len=MAX_LENGTH),
                     checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                     observe=ObserveConfig(eval_every=2, log_every=1, eval_tasks=tasks,
                                           eval_tasks_include_path=TASKS_DIR, eval_tasks_limit=3),
                     optimizer=OptimizerConfig(warmup_steps=0, learning_rate=3e-2))
    trainer = Trainer(exp, str(run_dir), devices=jax.devices()[:4], task_evaluator=TrainingTaskEvaluator)
    with count_compiles() as compiles:
        trainer.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if r["kind"] == "tasks"]
    assert [r["step"] for r in scored] == [2, 4]
    assert scored[0]["jaxtrain_local_rolling/word_perplexity"] != scored[1]["jaxtrain_local_rolling/word_perplexity"]
    assert {"jaxtrain_local_choice/acc", "jaxtrain_local_choice/acc_norm"} <= set(scored[1])
    assert compiles["step"] == 1, dict(compiles)  # the train step (jaxtrain/training/step.py)
    # the scoring programs compiled at the first evaluation only
    programs = trainer.task_evaluator.lm.scorer.programs
    assert compiles["_score_fn"] == len({p for p in programs if p[0] == "whole"}), dict(compiles)
    assert compiles["_prefill_fn"] == len({p for p in programs if p[0] == "prefill"}), dict(compiles)
    try:
        alone = JaxtrainLM(workdir=str(run_dir), batch_size=4)
    finally:
        gin.clear_config()
    expected = scalar_scores(run_tasks(alone, TaskRequest(tasks, include_path=TASKS_DIR, limit=3)))
    final = {k: v for k, v in scored[1].items() if k not in ("step", "kind")}
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert final[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.extended
@pytest.mark.end_to_end
def test_the_harness_cli_runs_the_jaxtrain_model(hf_dirs, manager, tmp_path):
    """`python -m jaxtrain.harness run --model jaxtrain ...`: the harness's own CLI in a fresh
    process, the model on data=2,tensor=2 (devices sized from model_args), writing the harness's
    results with the HF backend's scores."""
    import subprocess
    import sys

    from processes import REPO, child_env

    proc = subprocess.run(
        [sys.executable, "-m", "jaxtrain.harness", "run", "--model", "jaxtrain", "--model_args",
         f"hf_dir={hf_dirs['llama']},layout=data=2:tensor=2,max_length={MAX_LENGTH}", "--batch_size", "4",
         "--tasks", "jaxtrain_local_choice", "--include_path", TASKS_DIR, "--output_path", str(tmp_path / "out")],
        cwd=TASKS_DIR, env=child_env(PYTHONPATH=REPO, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jaxtrain_local_choice" in proc.stdout
    written = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results_*.json")]
    assert len(written) == 1
    expected = hf_results("llama", hf_dirs["llama"], manager)["results"]["jaxtrain_local_choice"]
    assert written[0]["results"]["jaxtrain_local_choice"]["acc,none"] == pytest.approx(expected["acc,none"])
