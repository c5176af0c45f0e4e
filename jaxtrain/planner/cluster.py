"""A cluster description: one or more groups of identical devices, and the links between them.

    {"groups": [{"name": "h100", "kind": "H100", "devices": 8},
                {"name": "rtx", "kind": "RTX PRO 6000", "devices": 8}],
     "inter_group_gbps": 25,
     "links": "links.jsonl"}

A group names a built-in kind (devices.py: H100, H200, B200, A100, RTX PRO 6000) and its
device count; any figure may be overridden (`memory_gib`, `peak_tflops`, `memory_gbps`,
`intra_node_gbps`, `inter_node_gbps`, `devices_per_node`), and a kind that is not built in must
give them all. `inter_group_gbps` is the per-device bandwidth between groups (default: the
slower group's inter-node figure). `links` (optional) is a file of measured link figures
written by `python -m jaxtrain.bench collectives --json` (links.py reads it).

`Cluster.from_args` also builds a one-group cluster from `--device H100 --devices 16`.
Everything wrong with a description is a ClusterError naming the group and the field.
"""
from __future__ import annotations

import dataclasses
import json
import os

from jaxtrain.planner.devices import GIB, DeviceSpec, builtin

# JSON field -> (DeviceSpec field, scale to the spec's unit)
_OVERRIDES = {"memory_gib": ("memory_bytes", GIB), "peak_tflops": ("peak_flops", 1e12),
              "memory_gbps": ("memory_gbps", 1.0), "intra_node_gbps": ("intra_node_gbps", 1.0),
              "inter_node_gbps": ("inter_node_gbps", 1.0), "devices_per_node": ("devices_per_node", 1)}
_GROUP_KEYS = {"name", "kind", "devices", *_OVERRIDES}
_CLUSTER_KEYS = {"groups", "inter_group_gbps", "links", "name"}


class ClusterError(ValueError):
    """A cluster description that is incomplete or inconsistent."""


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    name: str
    spec: DeviceSpec
    devices: int

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.spec.devices_per_node)


@dataclasses.dataclass(frozen=True)
class Cluster:
    groups: tuple[DeviceGroup, ...]
    inter_group_gbps: float | None = None
    links_file: str | None = None
    name: str = ""

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    @property
    def mixed(self) -> bool:
        return len(self.groups) > 1

    def describe(self) -> str:
        text = " + ".join(f"{g.devices} x {g.spec.kind}" + (f" ({g.name})" if g.name != g.spec.kind else "")
                          for g in self.groups)
        return f"{self.name}: {text}" if self.name else text

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, *, where: str = "cluster", base_dir: str = ".") -> "Cluster":
        if not isinstance(data, dict):
            raise ClusterError(f"{where}: expected a JSON object with 'groups', got {type(data).__name__}")
        unknown = sorted(set(data) - _CLUSTER_KEYS)
        if unknown:
            raise ClusterError(f"{where}: unknown field(s) {unknown}; known: {sorted(_CLUSTER_KEYS)}")
        groups = data.get("groups")
        if not isinstance(groups, list) or not groups:
            raise ClusterError(f"{where}: 'groups' must be a non-empty list of device groups")
        parsed = tuple(_group(g, f"{where} group {i}") for i, g in enumerate(groups))
        names = [g.name for g in parsed]
        if len(set(names)) != len(names):
            raise ClusterError(f"{where}: group names must differ, got {names}")
        links = data.get("links")
        if links is not None and not os.path.isabs(links):
            links = os.path.join(base_dir, links)
        if links is not None and not os.path.exists(links):
            raise ClusterError(f"{where}: links file {links!r} does not exist")
        inter = data.get("inter_group_gbps")
        if inter is not None and not _positive(inter):
            raise ClusterError(f"{where}: inter_group_gbps must be a positive number, got {inter!r}")
        return cls(parsed, inter_group_gbps=inter, links_file=links, name=str(data.get("name", "")))

    @classmethod
    def load(cls, path: str) -> "Cluster":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ClusterError(f"cluster description {path!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ClusterError(f"cluster description {path!r} is not valid JSON: {e}") from None
        return cls.from_dict(data, where=path, base_dir=os.path.dirname(os.path.abspath(path)))

    @classmethod
    def from_args(cls, *, cluster: str | None, device: str | None, devices: int | None) -> "Cluster":
        """--cluster FILE, or --device KIND with --devices N; --devices also checks a file's total."""
        if cluster is not None:
            out = cls.load(cluster)
            if device is not None:
                raise ClusterError("give either --cluster or --device, not both")
            if devices is not None and devices != out.devices:
                if out.mixed:
                    raise ClusterError(f"--devices {devices} does not match the {out.devices} devices of "
                                       f"{cluster} ({out.describe()})")
                out = dataclasses.replace(out, groups=(dataclasses.replace(out.groups[0], devices=devices),))
            out.check()
            return out
        if device is None:
            raise ClusterError("describe the cluster: --cluster FILE, or --device KIND --devices N")
        if devices is None or devices < 1:
            raise ClusterError(f"--device {device} needs --devices N (a positive count), got {devices}")
        out = cls((DeviceGroup(builtin(device).kind, builtin(device), devices),))
        out.check()
        return out

    def check(self) -> None:
        """Device counts that add up: whole nodes (or one partial node) per group."""
        for g in self.groups:
            per_node = g.spec.devices_per_node
            if g.devices > per_node and g.devices % per_node:
                raise ClusterError(f"group {g.name!r}: {g.devices} devices are not whole nodes of "
                                   f"{per_node} (devices_per_node)")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _group(data, where: str) -> DeviceGroup:
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: expected an object with 'kind' and 'devices', got {data!r}")
    unknown = sorted(set(data) - _GROUP_KEYS)
    if unknown:
        raise ClusterError(f"{where}: unknown field(s) {unknown}; known: {sorted(_GROUP_KEYS)}")
    kind, count = data.get("kind"), data.get("devices")
    if kind is None or count is None:
        missing = [k for k in ("kind", "devices") if data.get(k) is None]
        raise ClusterError(f"{where}: missing {' and '.join(repr(m) for m in missing)}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ClusterError(f"{where}: 'devices' must be a positive integer, got {count!r}")
    for key in _OVERRIDES:
        if key in data and not _positive(data[key]):
            raise ClusterError(f"{where}: {key!r} must be a positive number, got {data[key]!r}")
    overrides = {field: data[key] * scale for key, (field, scale) in _OVERRIDES.items() if key in data}
    if "devices_per_node" in overrides:
        overrides["devices_per_node"] = int(overrides["devices_per_node"])
    try:
        spec = dataclasses.replace(builtin(kind), **overrides)
    except ValueError:
        missing = [k for k in _OVERRIDES if k not in data]
        if missing:
            raise ClusterError(f"{where}: kind {kind!r} is not built in, so it needs every figure; "
                               f"missing {', '.join(missing)}") from None
        spec = DeviceSpec(kind=str(kind), **overrides)
    return DeviceGroup(str(data.get("name", spec.kind)), spec, count)
