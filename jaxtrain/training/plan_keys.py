"""The layout grammar, once: every key of a ParallelPlan spec string -> (plan field, parse, format).

A spec string is `key=value` parts joined by commas, e.g.
`pipeline=2,data=4,tensor=2,rules=fsdp,schedule=interleaved2,microbatches=8,remat=full`.
`ParallelPlan.with_spec` parses with this table, `ParallelPlan.spec` and `label` format with it,
and the README's layout-key table is generated from it (`markdown_table`; a test keeps them
equal). No jax here: the CLI reads a layout before jax starts, to size the simulated devices.
Names checked elsewhere are resolved where they live: rule tables in meshes/rules.py (imported
on first use: jax, but no backend), remat policies when the model is built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxtrain.meshes.context_settings import AllGatherKV, Contiguous, LatentKV, LoadBalanced, RingKV
from jaxtrain.meshes.mesh_config import AXES
from jaxtrain.meshes.pipeline_schedules import SCHEDULES, GPipe

KV_EXCHANGES = {"ring": RingKV, "allgather": AllGatherKV, "latent": LatentKV}
ORDERS = {"balanced": LoadBalanced, "contiguous": Contiguous}
# Attention implementations a layout may put into the model (models/layers/attention_impl.py):
# name -> (class name there, its arguments).
ATTENTION = {"materialized": ("MaterializedAttention", {}), "blockwise": ("BlockwiseAttention", {}),
             "pallas": ("PallasAttention", {}), "pallas_interpret": ("PallasAttention", {"interpret": True}),
             "auto": ("AutoAttention", {})}


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # as written in a spec string
    field: str  # the plan field it sets, dotted into nested values ("mesh.data")
    parse: Callable[[str], object]  # ValueError saying what is wrong
    format: Callable[[object], str]  # parse(format(v)) == v
    values: str  # what it accepts (errors and the README)
    doc: str


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None


def _positive(value: str) -> int:
    n = _int(value)
    if n < 1:
        raise ValueError(f"{n} must be positive")
    return n


def _ints(value: str) -> tuple[int, ...]:
    return tuple(_positive(v) for v in value.split("/"))


def _slashed(values) -> str:
    return "/".join(map(str, values))


def _optional(none_word: str, parse, format, none=None):
    """(parse, format) of a value that may be `none` (None, or () for a tuple), spelled `none_word`."""
    return (lambda v: none if v == none_word else parse(v)), (lambda v: none_word if v == none else format(v))


def _dcn(value: str) -> tuple[int, ...]:
    sizes = _ints(value)
    if len(sizes) != len(AXES):
        raise ValueError(f"give one factor per mesh axis ({'/'.join(AXES)}), got {len(sizes)}")
    return sizes


def _rules(value: str) -> str:
    from jaxtrain.meshes.rules import get_rule_set  # the rule tables need jax (no backend is started)
    get_rule_set(value)  # names the unknown table or overlay
    return value


def _schedule(value: str):
    name = value.rstrip("0123456789")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {value!r}: choose gpipe or interleaved<V> (e.g. interleaved2)")
    virtual = value[len(name):]
    if SCHEDULES[name] is GPipe:
        if virtual:
            raise ValueError("gpipe takes no virtual-stage count")
        return GPipe()
    return SCHEDULES[name](int(virtual) if virtual else 2)


def _schedule_name(schedule) -> str:
    name = next(n for n, cls in SCHEDULES.items() if isinstance(schedule, cls))
    return name if isinstance(schedule, GPipe) else f"{name}{schedule.virtual_stages}"


def _choice(table: dict, key: str):
    def parse(value: str):
        if value not in table:
            raise ValueError(f"{key}={value!r}: choose one of {'|'.join(table)}")
        return table[value]()

    def format(obj) -> str:
        return next(n for n, cls in table.items() if type(obj) is cls)
    return parse, format


def _word(value: str) -> str:
    if not value.replace("_", "").isalnum():
        raise ValueError(f"{value!r} is not a name")
    return value


def _attention(value: str) -> str:
    if value not in ATTENTION:
        raise ValueError(f"attention={value!r}: choose one of {'|'.join(ATTENTION)}")
    return value


KEYS: tuple[Key, ...] = (
    *(Key(a, f"mesh.{a}", _int, str, "integer (-1: the devices left)",
          f"size of the `{a}` mesh axis; naming any axis sets the unnamed ones to 1") for a in AXES),
    Key("dcn", "mesh.dcn", *_optional("auto", _dcn, _slashed), "a/b/c/d/e | auto",
        "per-axis factor spanning processes (DCN), in axis order; auto: processes over the outer axes first"),
    Key("rules", "rules", _rules, str, "table[+overlay...]",
        "rule table and overlays of meshes/rules.py, e.g. fsdp+experts_folded+opt_host"),
    Key("microbatches", "microbatches", _positive, str, "integer",
        "gradient accumulation steps, or the microbatches a pipeline streams"),
    Key("schedule", "schedule", _schedule, _schedule_name, "gpipe | interleaved<V>",
        "pipeline schedule (meshes/pipeline_schedules.py); used when pipeline > 1"),
    Key("split", "split", *_optional("auto", _ints, _slashed), "a/b/... | auto",
        "layers per pipeline chunk in model order; auto: balanced by per-layer cost"),
    Key("stage_remat", "stage_remat", _word, str, "none | layer | stage",
        "what a pipeline stage rematerializes (models/stage_program.py)"),
    Key("stage_loop", "stage_loop", _word, str, "auto | runs | switched | kinds",
        "how a stage with alternating layer kinds loops over its slots (models/stage_program.py)"),
    Key("order", "context_parallel.layout", *_choice(ORDERS, "order"), " | ".join(ORDERS),
        "which sequence chunks each `context` rank holds (meshes/context_settings.py)"),
    Key("kv", "context_parallel.kv_exchange", *_choice(KV_EXCHANGES, "kv"), " | ".join(KV_EXCHANGES),
        "how `context` ranks see each other's keys and values (latent: MLA gathers its latent)"),
    Key("remat", "remat", *_optional("model", _word, str), "none | dots_no_batch | full | offload_dots | model",
        "the model's remat policy, overriding its config (models/layers/stack.py); model: the config's own"),
    Key("attention", "attention", *_optional("model", _attention, str), " | ".join([*ATTENTION, "model"]),
        "the model's attention implementation, overriding its config; model: the config's own"),
    Key("groups", "groups", *_optional("none", _ints, _slashed, none=()), "a/b/... | none",
        "device groups: rows of each global batch per group, each group laid out by the rest of the plan "
        "(jaxtrain/training/device_groups.py)"),
)
BY_NAME = {k.name: k for k in KEYS}


def get(obj, field: str):
    for name in field.split("."):
        obj = getattr(obj, name)
    return obj


def replace(obj, field: str, value):
    """`obj` with the dotted `field` set to `value` (frozen dataclasses all the way down)."""
    head, _, rest = field.partition(".")
    return dataclasses.replace(obj, **{head: replace(getattr(obj, head), rest, value) if rest else value})


def unknown_key(key: str) -> str:
    return f"unknown key {key!r}: use one of {', '.join(BY_NAME)}"


def markdown_table() -> str:
    """The README's table of layout keys."""
    rows = ["| key | values | meaning |", "|---|---|---|"]
    for k in KEYS:
        values = k.values.replace("|", "\\|")  # a cell ends at any unescaped pipe, inside backticks too
        rows.append(f"| `{k.name}` | `{values}` | {k.doc} |")
    return "\n".join(rows)
