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


# What a field sets where the code gives it no comment (the code's own comment always wins), by
# "Class.field" or, for names every model family shares, by ".field". Shown in italics, so the page
# says which words are the code's. A field listed here that no configurable has fails the docs tests.
FALLBACK = {
    "Experiment.model": "the model config, e.g. `@LlamaConfig()` (required)",
    "Experiment.mesh": "the mesh axis sizes; unbound: `MeshConfig`'s bindings",
    "Experiment.train": "the run's shape; unbound: `TrainConfig`'s bindings",
    "Experiment.data": "training and evaluation data; unbound: `DataConfig`'s bindings",
    "Experiment.optimizer": "AdamW and its schedule; unbound: `OptimizerConfig`'s bindings",
    "Experiment.checkpoint": "when to save and how to resume; unbound: `CheckpointConfig`'s bindings",
    "Experiment.resilience": "peers, hangs, non-finite steps; unbound: `ResilienceConfig`'s bindings",
    "Experiment.observe": "logs, evals, samples, profiles; unbound: `ObserveConfig`'s bindings",
    "TrainConfig.steps": "optimizer steps of the run",
    "TrainConfig.global_batch": "sequences per step, over all devices",
    "TrainConfig.seq_len": "tokens per sequence",
    "TrainConfig.seed": "parameter initialization and data order",
    "OptimizerConfig.learning_rate": "the peak learning rate, reached after the warmup",
    "OptimizerConfig.warmup_steps": "steps of linear warmup from zero",
    "OptimizerConfig.b1": "AdamW's first-moment decay",
    "OptimizerConfig.b2": "AdamW's second-moment decay",
    "OptimizerConfig.eps": "AdamW's epsilon",
    "OptimizerConfig.weight_decay": "decoupled weight decay (not on norm scales, biases or `no_decay` parameters)",
    "OptimizerConfig.clip_norm": "global gradient-norm clipping; None: no clipping",
    "CheckpointConfig.keep_checkpoints": "the newest checkpoints kept; older ones are deleted",
    "CheckpointConfig.async_checkpoint": "write checkpoints in the background while training goes on",
    "ResilienceConfig.hang_factor": "a later step hangs past this many times the median step",
    "ResilienceConfig.hang_min_s": "a later step is never called hung before this many seconds",
    "ResilienceConfig.hang_first_steps_s": "bound of each of the first two steps, compilation included",
    "ResilienceConfig.hang_restore_s": "bound of the restore or initialization",
    "ResilienceConfig.hang_save_s": "bound of a save with its wait for the write",
    "ResilienceConfig.hang_eval_s": "bound of an eval",
    "ObserveConfig.log_every": "steps between printed log lines",
    "ObserveConfig.eval_batches": "batches of each periodic eval",
    "ObserveConfig.sample_prompts": "the prompts of the samples",
    "ObserveConfig.sample_tokens": "new tokens per sample",
    "ObserveConfig.eval_tasks_include_path": "a folder of your own task YAMLs",
    "ObserveConfig.eval_tasks_limit": "documents per task (a fraction if below 1)",
    "DeviceGroups.rows": "rows of each global batch per device group; (): no groups",
    "Rollback.max_rollbacks": "halt after this many rollbacks without getting further",
    "Skip.max_consecutive": "halt after this many non-finite steps in a row",
    "MeshConfig.pipeline": "pipeline stages",
    "MeshConfig.data": "data-parallel size (-1: the devices left)",
    "MeshConfig.context": "context-parallel size: the sequence split over devices",
    "MeshConfig.expert": "expert-parallel size (a second data axis for dense models)",
    "MeshConfig.tensor": "tensor-parallel size",
    "ContextParallel.layout": "which sequence chunks each context rank holds: `@LoadBalanced()` or `@Contiguous()`",
    "ContextParallel.kv_exchange": "what crosses `context` for attention: `@RingKV()`, `@AllGatherKV()` or "
                                   "`@LatentKV()`",
    "Interleaved.virtual_stages": "chunks per stage: passes a microbatch makes through the stages",
    "LoraConfig.rank": "the adapters' rank",
    "LoraConfig.alpha": "scale numerator: adapters add (alpha / rank) x B(A(x))",
    "LoraConfig.dropout": "adapter dropout; only 0.0 is supported",
    "LoraConfig.targets": "the projections that get adapters, by the family's target names",
    "LoraModelConfig.base": "the model config the adapters go on",
    "LoraModelConfig.lora": "the adapters",
    "RouterConfig.num_experts": "routed experts per MoE layer",
    "RouterConfig.top_k": "experts each token is routed to",
    "RouterConfig.norm_topk_prob": "renormalize the chosen experts' weights to sum to 1",
    "RouterConfig.routed_scaling_factor": "multiplies the routed experts' output",
    ".vocab_size": "embedding rows: at least the tokenizer's ids",
    ".embed": "model width",
    ".layers": "number of layers",
    ".heads": "attention query heads",
    ".kv_heads": "key/value heads (grouped-query attention)",
    ".head_dim": "width of one attention head",
    ".mlp": "hidden width of the dense MLPs",
    ".rope_theta": "base of the rotary position frequencies",
    ".rope_scaling": "rotary scaling: `@NoScaling()`, `@LinearScaling()`, `@Llama3Scaling()` or `@YarnScaling()`",
    ".norm_eps": "epsilon of the RMSNorms",
    ".tie_embeddings": "share the embedding table with the LM head",
    ".attention_bias": "biases on the attention projections",
    ".mlp_bias": "biases on the MLP projections",
    ".init_std": "standard deviation of the normal weight initialization",
    ".dtype": "compute dtype (`bfloat16` for mixed precision); parameters and optimizer state stay float32",
    ".remat": "activation rematerialization per layer: {remat}",
    ".router": "the MoE router (`RouterConfig`)",
    ".ssm": "the Mamba-2 mixer (`SSMConfig`)",
    ".kv_lora_rank": "MLA's key/value latent width",
    ".qk_nope_head_dim": "MLA's per-head query/key width without rotary positions",
    ".qk_rope_head_dim": "MLA's per-head rotary query/key width",
    ".v_head_dim": "MLA's per-head value width",
    ".block_k": "keys per block; None: the kernel's default",
    ".factor": "the scaling factor",
    ".conv_kernel": "taps of the short causal convolution",
}


def fallback_note(name: str, field: str) -> str:
    from jaxtrain.models.layers.layer_scan import REMAT_POLICIES

    text = FALLBACK.get(f"{name}.{field}") or FALLBACK.get(f".{field}", "")
    return f"*{text.format(remat=', '.join(f'`{p}`' for p in REMAT_POLICIES))}*" if text else ""


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
           "field's default and the comment the code gives it (in italics where the code gives none: a",
           "short description kept with the docs). How gin files and bindings work is on the",
           "[configuration page](../configuration.md); layouts have their own grammar",
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
            note = note or fallback_note(name, f.name)
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
    from jaxtrain.meshes import rules

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
    from jaxtrain.meshes import rules

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
