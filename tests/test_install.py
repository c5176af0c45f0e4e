"""jaxtrain as a user installs it: one import name, the bundled configs and corpus found from any
folder, a console script, and optional dependencies that fail in one line naming what to install."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile

import pytest

from processes import child_env

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_bundled_config_is_found_by_name_and_a_path_wins(tmp_path, monkeypatch):
    from jaxtrain import bundled

    assert bundled.gin_file("deepseek_v2_lite") == str(bundled.CONFIGS / "deepseek_v2_lite.gin")
    assert bundled.gin_file("deepseek_v2_lite.gin") == str(bundled.CONFIGS / "deepseek_v2_lite.gin")
    assert bundled.gin_file("configs/default.gin") in ("configs/default.gin", str(bundled.ROOT / "configs/default.gin"))
    mine = tmp_path / "deepseek_v2_lite.gin"
    mine.write_text("")
    monkeypatch.chdir(tmp_path)
    assert bundled.gin_file("deepseek_v2_lite.gin") == "deepseek_v2_lite.gin"  # the user's own file
    assert bundled.gin_file("no_such.gin") == "no_such.gin"  # left for the caller's not-found error
    assert "default.gin" in bundled.bundled_configs()


def test_a_missing_extra_is_one_line_naming_what_to_install(monkeypatch):
    from jaxtrain.data.tokenizer import HFTokenizer
    from jaxtrain.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(MissingExtra) as raised:
        HFTokenizer("some/tokenizer")
    message = str(raised.value)
    assert "\n" not in message and "pip install 'jaxtrain[hf]'" in message and "some/tokenizer" in message
    assert isinstance(raised.value, ValueError)  # what every CLI reports as `error: ...`, exit 2


def test_the_console_script_lists_every_program_and_runs_one(capsys):
    from jaxtrain.cli import main

    assert main.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in main.COMMANDS)
    assert main.main(["no_such_command"]) == 2
    with pytest.raises(SystemExit) as exited:
        main.main(["plan", "--help"])
    assert exited.value.code == 0 and "--gin_file" in capsys.readouterr().out


# In test-extended for its time (a wheel build and a run in a new virtualenv); the suite keeps its
# parts: bundled files found by name, the console script, the missing-extra message.
@pytest.mark.slow
@pytest.mark.end_to_end
@pytest.mark.extended
def test_the_wheel_installs_one_name_and_trains_outside_the_checkout(tmp_path):
    """The built wheel in a fresh virtualenv (its dependencies taken from this interpreter's
    site-packages, so nothing downloads), run from a folder outside the checkout: `jaxtrain --help`
    and three steps of the default config on the bundled corpus."""
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", REPO,
                            "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = glob.glob(str(wheels / "jaxtrain-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = z.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert top_level == ["jaxtrain"]
    assert {n.split("/")[0] for n in names} == {"jaxtrain", os.path.basename(wheel).split("-py3")[0] + ".dist-info"}
    assert "jaxtrain/bundled/configs/default.gin" in names and "jaxtrain/bundled/data/tiny_corpus/train.txt" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "dependencies.pth"), "w") as f:  # jax, flax, ... from this interpreter
        f.write("\n".join(ours) + "\n")
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", "--no-index", "-q", wheel],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("PYTHONPATH", None)
    python = str(venv / "bin" / "python")
    where = subprocess.run([python, "-c", "import jaxtrain.models.llama as m; print(m.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith(site), (where.stdout, where.stderr[-2000:])
    listed = subprocess.run([str(venv / "bin" / "jaxtrain"), "--help"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "train" in listed.stdout
    trained = subprocess.run([python, "-m", "jaxtrain.train", "--workdir=runs/first", "--gin_param=TrainConfig.steps=3",
                              "--gin_param=LlamaConfig.layers=2", "--gin_param=ObserveConfig.eval_batches=1"],
                             cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (elsewhere / "runs" / "first" / "checkpoints" / "3").is_dir()
