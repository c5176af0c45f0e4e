"""MkDocs hook: the reference parts of the docs, generated from the code at every build so they
cannot drift from it.

- `reference/configuration.md`: every gin configurable the CLIs know, each field with its type,
  its default and the comment the code gives it (read from the source, so a comment added in the
  code shows up here at the next build).
- `<!-- generated: layout-keys -->` in a page: the layout-string table of
  jaxtrain/training/plan_keys.py, the table the parser itself runs on.
- `<!-- generated: cli-help MODULE [ARGS] -->` in a page: that program's `--help`, from its own
  argparse parser.
- `results.md`: benchmarks/RESULTS.md as it is in the checkout, so the docs link to the measured
  figures without copying them.

Importing jaxtrain here imports jax; nothing is compiled and no device is used.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import typing

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GENERATED = re.compile(r"<!-- generated: ([\w-]+)(?: ([^>]*?))? -->")
# Sections of the configuration reference, by the gin module a configurable is registered under,
# and the configurables a newcomer looks for first; anything else follows alphabetically, so a new
# configurable appears without anyone listing it.
SECTIONS = {
    "jaxtrain": ("The run", "What a run trains on and how it is checkpointed, kept alive and observed.",
                 ("Experiment", "TrainConfig", "DataConfig", "OptimizerConfig", "LossConfig", "CheckpointConfig",
                  "ResilienceConfig", "ObserveConfig", "PipelineConfig", "DeviceGroups")),
    "meshes": ("The mesh and its algorithms", "Mesh axis sizes, pipeline schedules and context-parallel settings.",
               ("MeshConfig", "ContextParallel")),
    "models": ("Models", "The model families and the parts their gin files name (routers, SSM mixers, "
               "rotary scalings, attention strategies, adapters).",
               ("LlamaConfig", "DeepSeekConfig", "NemotronHConfig", "Mamba2Config")),
}


# ---------------------------------------------------------------------------------------------
# The configuration reference


def configurables() -> list[tuple[str, str, type]]:
    """(gin module, gin name, dataclass) of every registered configurable that builds a config
    dataclass, in the reference's order. A configurable registered as a function (TrainConfig,
    which also accepts old bindings) is documented by the dataclass its return annotation names."""
    import gin
    from gin import config as gin_config

    import jaxtrain.training.config  # noqa: F401  (registers every configurable the CLIs know)

    found = []
    for _, configurable in gin_config._REGISTRY.items():  # gin has no public listing
        if configurable.module not in SECTIONS:
            continue
        target = configurable.wrapped
        if not isinstance(target, type):
            target = typing.get_type_hints(target).get("return")
        if dataclasses.is_dataclass(target):
            found.append((configurable.module, configurable.name, target))
    del gin

    def order(item):
        module, name, _ = item
        first = SECTIONS[module][2]
        return (list(SECTIONS).index(module), first.index(name) if name in first else len(first), name)

    return sorted(found, key=order)


def _class_source(klass: type) -> str | None:
    try:
        return textwrap.dedent("".join(inspect.getsourcelines(klass)[0]))
    except (OSError, TypeError):
        return None


def field_notes(cls: type) -> dict[str, tuple[str, str]]:
    """{field: (annotation as written, its comment)}: the comment lines right above a field plus the
    one on its line (and that one's indented continuation lines), searched through the dataclass
    bases too."""
    notes = {}
    for klass in reversed(cls.__mro__):
        source = _class_source(klass) if dataclasses.is_dataclass(klass) else None
        if source is None:
            continue
        lines = source.splitlines()
        comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT}

        def comment_only(n):
            return 1 <= n <= len(lines) and lines[n - 1].lstrip().startswith("#")

        def text(n):
            return comments[n].lstrip("#").strip()

        continuation = set()
        body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, n = [], node.lineno - 1
            while comment_only(n) and n not in continuation:
                above.insert(0, text(n))
                n -= 1
            same = [text(n) for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            n = node.end_lineno + 1
            while same and comment_only(n) and re.match(r"\s*#\s{2,}", lines[n - 1]):
                continuation.add(n)  # "#   more of the comment above" under a trailing comment
                same.append(text(n))
                n += 1
            notes[node.target.id] = (ast.get_source_segment(source, node.annotation) or "",
                                     " ".join(above + same))
    return notes


def _default(field: dataclasses.Field, registered: dict[type, str]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value) and type(value) in registered:
        name = registered[type(value)]
        changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                   if _default(f, registered) != repr(getattr(value, f.name))]
        return f"@{name}({', '.join(changed)})"  # gin's spelling; only what differs from its own defaults
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configuration_markdown() -> str:
    items = configurables()
    registered = {cls: name for _, name, cls in items}
    out = ["# Configuration reference", "",
           "Generated from the code at every docs build: every gin configurable the CLIs know, each",
           "field's default and the comment the code gives it. How gin files and bindings work is on",
           "the [configuration page](../configuration.md); layouts have their own grammar",
           "([layout strings](../layouts.md#layout-strings)).", ""]
    section = None
    for module, name, cls in items:
        if module != section:
            section = module
            title, about, _ = SECTIONS[module]
            out += [f"## {title}", "", about, ""]
        path = os.path.relpath(inspect.getsourcefile(cls), REPO)
        out += [f"### {name}", "", f"`@{name}()` in gin; defined in `{path}` as `{cls.__name__}`.", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses invent a signature docstring
            out += [doc, ""]
        notes = field_notes(cls)
        fields = dataclasses.fields(cls)
        if not fields:
            out += ["No fields.", ""]
            continue
        out += ["| field | type | default | what it sets |", "|---|---|---|---|"]
        for f in fields:
            annotation, note = notes.get(f.name, (str(f.type), ""))
            out.append(f"| `{name}.{f.name}` | `{_cell(annotation)}` | `{_cell(_default(f, registered))}` | "
                       f"{_cell(note)} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# CLI help and the layout keys


def cli_module(name: str) -> str:
    """The module whose main() is the program `python -m NAME` runs."""
    candidate = name.replace("jaxtrain.", "jaxtrain.cli.", 1)
    try:
        importlib.import_module(candidate)
        return candidate
    except ImportError:
        return name


def cli_help(name: str, *args: str) -> str:
    """What `python -m NAME ARGS --help` prints, from the program's own parser, in-process."""
    module = importlib.import_module(cli_module(name))
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page should not depend on it
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            module.main([*args, "--help"])
    except SystemExit:
        pass
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    if not out.getvalue().startswith("usage:"):
        raise RuntimeError(f"`python -m {name} {' '.join(args)} --help` printed no usage")
    return out.getvalue()


def _axes_groups(table) -> str:
    """`heads`, `mlp` → tensor; ...: the names of a rule table grouped by the axes they map to."""
    groups: dict[tuple, list[str]] = {}
    for name, axes in table.items():
        groups.setdefault(tuple(axes), []).append(name)
    return "; ".join(f"{', '.join(f'`{n}`' for n in names)} → {' × '.join(axes) or 'whole'}"
                     for axes, names in groups.items())


def rule_tables_markdown() -> str:
    """The base rule tables of meshes/rules.py as they are: which mesh axes each logical name maps
    to for parameters, activations and optimizer state, and how FSDP weights are gathered."""
    from meshes import rules

    out = ["| table | parameters | activations | optimizer state | weights gathered |", "|---|---|---|---|---|"]
    for name, rule_set in rules.RULE_SETS.items():
        optimizer = "like the parameters" if rule_set.optimizer is None else _axes_groups(rule_set.optimizer)
        out.append(f"| `{name}` | {_axes_groups(rule_set.params)} | {_axes_groups(rule_set.activations)} | "
                   f"{optimizer} | `{rule_set.weight_gather}` |")
    overlays = [*rules.OVERLAYS, *rules.SET_OVERLAYS]
    out += ["", "Overlays the code knows (written after a table with `+`): "
            + ", ".join(f"`+{name}`" for name in overlays) + "."]
    return "\n".join(out)


def logical_names_markdown() -> str:
    """Every logical dimension name of meshes/rules.py with its meaning."""
    from meshes import rules

    when = {"error": "an error", "replicate": "kept whole along the axes that do not divide",
            "replicate_single": "kept whole if its size is 1, else an error"}
    out = ["| name | what it names | a size its mesh axes do not divide |", "|---|---|---|"]
    for name, logical in rules.LOGICAL_NAMES.items():
        out.append(f"| `{name}` | {_cell(logical.meaning)} | {when[logical.indivisible.value]} |")
    return "\n".join(out)


def expand(markdown: str) -> str:
    """Replaces each `<!-- generated: ... -->` marker with what it names."""
    from jaxtrain.training import plan_keys

    def one(match):
        what, args = match.group(1), (match.group(2) or "").split()
        if what == "layout-keys":
            return plan_keys.markdown_table()
        if what == "rule-tables":
            return rule_tables_markdown()
        if what == "logical-names":
            return logical_names_markdown()
        if what == "cli-help":
            return "```text\n" + cli_help(*args).rstrip() + "\n```"
        raise ValueError(f"unknown generated block {what!r}")

    return GENERATED.sub(one, markdown)


# ---------------------------------------------------------------------------------------------
# MkDocs events


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/configuration.md", content=configuration_markdown()))
    files.append(File.generated(config, "results.md", abs_src_path=os.path.join(REPO, "benchmarks", "RESULTS.md")))
    return files


def on_page_markdown(markdown, page, config, files):
    return expand(markdown)
