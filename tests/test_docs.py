"""The README and the docs site: the site builds strictly (no broken link or anchor, every page in
the nav), the front page stays a front page, no prose carries a date, an issue number or a commit
hash, the generated configuration reference lists every field of every configurable, every CLI
flag and gin binding the prose uses exists in the code, and the getting-started commands run."""
import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from processes import REPO, child_env
from test_code_comments import offences

pytestmark = [pytest.mark.fast]

README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
PROSE = [README, *PAGES]
GETTING_STARTED = os.path.join(DOCS, "getting-started.md")
RUNNABLE = "<!-- runnable:"  # a page marks the fenced block after this line as commands a test runs


@pytest.fixture(scope="module")
def reference():
    """docs/hooks/reference.py, the hook that generates the reference pages, as a module."""
    spec = importlib.util.spec_from_file_location("docs_reference_hook", os.path.join(DOCS, "hooks", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # one mkdocs build, ~10 s: the hook imports jaxtrain and renders every page
def test_the_docs_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          env=child_env(JAX_PLATFORMS="cpu", NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference_page = (site / "reference" / "configuration" / "index.html").read_text()
    assert "TrainConfig.global_batch" in reference_page and "LlamaConfig.kv_heads" in reference_page
    assert "usage: python -m jaxtrain.train" in (site / "cli" / "index.html").read_text()
    assert "generated:" not in (site / "layouts" / "index.html").read_text()  # every marker was expanded
    assert (site / "results" / "index.html").exists()


@pytest.mark.parametrize("fault", ["broken_link", "broken_anchor", "page_left_out"])
def test_the_strict_build_fails_on_broken_links_anchors_and_pages_left_out_of_the_nav(tmp_path, fault):
    """A two-page site under the project's own validation settings (mkdocs.yml), built as `make
    docs` builds: each fault fails the build, and the clean site passes."""
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        validation = yaml.safe_load(f)["validation"]
    assert "--strict" in open(os.path.join(REPO, "Makefile")).read()

    def build(pages: dict, nav: list) -> subprocess.CompletedProcess:
        docs = tmp_path / fault / "docs"
        docs.mkdir(parents=True, exist_ok=True)
        for name, text in pages.items():
            (docs / name).write_text(text)
        (docs.parent / "mkdocs.yml").write_text(yaml.safe_dump({"site_name": "t", "nav": nav, "validation": validation}))
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(docs.parent / "site")],
                              cwd=docs.parent, env=child_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True,
                              timeout=120)

    clean = {"index.md": "# Home\n\nSee [the other page](other.md#part).\n", "other.md": "# Other\n\n## Part\n"}
    assert build(clean, ["index.md", "other.md"]).returncode == 0
    broken = {"broken_link": {"index.md": "# Home\n\nSee [nothing](missing.md).\n"},
              "broken_anchor": {"index.md": "# Home\n\nSee [the other page](other.md#no-such-part).\n"},
              "page_left_out": {"extra.md": "# Extra\n"}}[fault]
    proc = build({**clean, **broken}, ["index.md", "other.md"])
    assert proc.returncode != 0, proc.stderr[-2000:]


def test_the_readme_is_a_front_page():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move explanation into docs/, figures into " \
                              "benchmarks/RESULTS.md"


def test_readme_docs_and_the_docs_hook_carry_no_date_issue_or_commit():
    found = offences([os.path.join(DOCS, "hooks")], PROSE)
    assert not found, "say why, not when (figures with their date and commit go to benchmarks/RESULTS.md):\n" + \
                      "\n".join(found)


def test_the_configuration_reference_lists_every_field_of_every_configurable(reference):
    import gin.config

    page = reference.configuration_markdown()
    found = reference.configurables()
    names = {name for _, name, _ in found}
    assert {"Experiment", "TrainConfig", "MeshConfig", "DataConfig", "OptimizerConfig", "LossConfig",
            "CheckpointConfig", "ResilienceConfig", "ObserveConfig", "PipelineConfig", "LoraConfig", "LlamaConfig",
            "DeepSeekConfig", "NemotronHConfig", "Mamba2Config", "RouterConfig", "SSMConfig"} <= names
    # every gin configurable of the three modules the CLIs bind is documented
    registered = {c.name for _, c in gin.config._REGISTRY.items() if c.module in reference.SECTIONS}
    assert registered == names
    sections = re.split(r"^### ", page, flags=re.MULTILINE)
    for _, name, cls in found:
        section = next(s for s in sections if s.startswith(f"{name}\n"))
        rows = re.findall(r"^\| `" + re.escape(name) + r"\.(\w+)` \|", section, flags=re.MULTILINE)
        assert rows == [f.name for f in dataclasses.fields(cls)], name
    # the hook's stand-in descriptions name fields that exist
    fields = {f"{n}.{f.name}" for _, n, c in found for f in dataclasses.fields(c)}
    stale = [k for k in reference.FALLBACK
             if not (k in fields or k.startswith(".") and any(f.endswith(k) for f in fields))]
    assert not stale, f"docs/hooks/reference.py FALLBACK describes fields no configurable has: {stale}"
    # the comments the code gives a field, above it, beside it and continued below it
    notes = reference.field_notes(dict((n, c) for _, n, c in found)["RouterConfig"])
    assert "dropless" in notes["capacity_factor"][1] and "proportional to cf" in notes["capacity_factor"][1]
    assert "rule table" in reference.field_notes(dict((n, c) for _, n, c in found)["TrainConfig"])["rules"][1]


def test_the_generated_tables_come_from_the_code(reference):
    from jaxtrain.training import plan_keys
    from jaxtrain.meshes import rules

    expanded = reference.expand("<!-- generated: layout-keys -->\n<!-- generated: rule-tables -->\n"
                                "<!-- generated: logical-names -->")
    assert plan_keys.markdown_table() in expanded
    assert all(f"| `{name}` |" in expanded for name in [*rules.RULE_SETS, *rules.LOGICAL_NAMES])
    layouts = open(os.path.join(DOCS, "layouts.md")).read()
    undocumented = [o for o in [*rules.OVERLAYS, *rules.SET_OVERLAYS] if f"`+{o}`" not in layouts]
    assert not undocumented, f"docs/layouts.md explains no overlay {undocumented}"


def _commands(text: str):
    """(module, argument text) of every `python -m jaxtrain...` the text shows, in code blocks or
    inline, continuation lines joined; a command ends at a backtick, a line end or a shell operator."""
    text = text.replace("\\\n", " ")
    for match in re.finditer(r"python -m (jaxtrain(?:\.\w+)*)([^`\n]*)", text):
        yield match.group(1), re.split(r"&&|\|\||;| \| ", match.group(2))[0]


def test_every_cli_flag_the_docs_use_exists(reference):
    helps = {}
    wrong = []
    for path in PROSE:
        for module, args in _commands(open(path).read()):
            if module == "jaxtrain.harness":  # lm-evaluation-harness's own command line
                continue
            words = args.split()
            key = (module, *words[:1]) if module == "jaxtrain.data" and words[:1] in (["prepare"], ["info"]) \
                else (module,)
            if key not in helps:
                helps[key] = set(re.findall(r"(?<![\w-])--(\w+)", reference.cli_help(*key)))
            wrong += [f"{os.path.relpath(path, REPO)}: python -m {module} --{flag}"
                      for flag in re.findall(r"(?<![\w-])--(\w+)", args) if flag not in helps[key]]
    assert helps, "no command found in the docs"
    assert not wrong, "flags the programs do not have:\n" + "\n".join(wrong)


def test_every_gin_binding_the_docs_name_exists(reference):
    from jaxtrain.training.moved_bindings import MOVED

    classes = {name: cls for _, name, cls in reference.configurables()}
    wrong = []
    for path in PROSE:
        for name, attribute in re.findall(r"\b([A-Z]\w+)\.([a-z_]\w*)\b", open(path).read()):
            cls = classes.get(name)
            if cls is None or attribute in {f.name for f in dataclasses.fields(cls)} or hasattr(cls, attribute):
                continue
            if name == "TrainConfig" and attribute in MOVED:  # an old binding that still loads
                continue
            wrong.append(f"{os.path.relpath(path, REPO)}: {name}.{attribute}")
    assert not wrong, "bindings the configs do not have:\n" + "\n".join(sorted(set(wrong)))


def runnable_commands(page: str) -> list[list[str]]:
    """The commands of the fenced block after the page's runnable marker, each split as a shell would."""
    lines = open(page).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(RUNNABLE))
    assert lines[start + 1].startswith("```"), f"{page}: the runnable marker must precede a fenced block"
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("```"))
    block = "\n".join(lines[start + 2:end]).replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# Appended to each program of the getting-started page so the test stays cheap: a 2-layer model of
# width 64 for 3 steps (the eval and generate commands read it back from the workdir's config.gin),
# fewer eval dispatches and a short generation. Later flags win over the page's own.
SHORTER = {
    "jaxtrain.train": ["--gin_param=TrainConfig.steps=3", "--gin_param=ObserveConfig.eval_batches=1",
                       "--gin_param=LlamaConfig.embed=64", "--gin_param=LlamaConfig.layers=2",
                       "--gin_param=LlamaConfig.heads=4", "--gin_param=LlamaConfig.kv_heads=2",
                       "--gin_param=LlamaConfig.mlp=128"],
    "jaxtrain.eval": ["--batch_size=64"],
    "jaxtrain.generate": ["--max_new_tokens=8"],
}


def shortened(argv: list[str], root) -> list[str]:
    """A page's command as the test runs it: this interpreter, workdirs under `root`, SHORTER appended."""
    assert argv[:2] == ["python", "-m"] and argv[2] in SHORTER, f"not a jaxtrain command the test knows: {argv}"
    args = [f"--workdir={os.path.join(root, a.split('=', 1)[1])}" if a.startswith("--workdir=") else a
            for a in argv[3:]]
    return [sys.executable, "-m", argv[2], *args, *SHORTER[argv[2]]]


def test_the_getting_started_page_marks_train_eval_and_generate(tmp_path):
    commands = [shortened(argv, tmp_path) for argv in runnable_commands(GETTING_STARTED)]
    assert [c[2] for c in commands] == ["jaxtrain.train", "jaxtrain.eval", "jaxtrain.generate"]
    assert all(f"--workdir={tmp_path}/runs/first" in c for c in commands)


# Kept out of `make test` for its time (three CLI processes): its twins there are the page check
# above (the commands parse, their flags and bindings exist) and tests/test_cli.py, which runs the
# same train, eval and generate programs on a tiny model.
@pytest.mark.slow
@pytest.mark.end_to_end
@pytest.mark.extended
def test_the_getting_started_commands_run(tmp_path):
    """The page's train, eval and generate commands, each in its own process as a reader runs them
    (shortened: SHORTER)."""
    outputs = []
    for argv in runnable_commands(GETTING_STARTED):
        proc = subprocess.run(shortened(argv, tmp_path), cwd=REPO, env=child_env(JAX_PLATFORMS="cpu"),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{shlex.join(argv)}:\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "first" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    scored = json.loads(next(line for line in reversed(outputs[1].splitlines()) if line.startswith("{")))
    assert math.isfinite(scored["perplexity"]) and scored["perplexity"] > 1 and scored["checkpoint_step"] == 3
    # generate's own exit status is the check: three steps of training may well sample the end of text first
