"""Planning for a cluster of several device groups (mixed GPUs).

What jaxtrain can run on such a cluster, and what the planner compares:

  data parallel, balanced   every group runs the same within-group layout on its own share of
                            the batch, in whole microbatches, as many as its speed warrants
                            (jaxtrain/training/device_groups.py); the groups' gradients are summed
                            over the link between them after their microbatches
  data parallel, even       the same with equal shares: the slower group sets the step
  pipeline across groups    one stage per group. The pipeline is one SPMD program: every stage
                            runs the same slot pattern each tick, so a stage given fewer layers
                            runs padded slots and is no faster — an uneven split cannot help the
                            slower group (meshes/pipeline_split.py). Every tick takes the slower
                            stage's time.

Shares come from each group's time for one microbatch: measured (`--calibration`: JSON lines
of `python -m jaxtrain.bench step --json` run on one node of each kind, matched by device kind)
or predicted by the time model. Balancing hands out microbatches one at a time to the group
that would finish it first.
"""
from __future__ import annotations

import dataclasses
import json
import math

from jaxtrain.planner.candidates import candidates
from jaxtrain.planner.cluster import Cluster, ClusterError
from jaxtrain.planner.links import BETWEEN_GROUPS, LinkTable
from jaxtrain.planner.planner import NoLayoutFits, Planner, Workload
from jaxtrain.training.parallel_plan import ParallelPlan

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    candidate: ParallelPlan  # the within-group layout (its batch: one microbatch of the step)
    microbatches: int  # of the whole step
    microbatch_seconds: tuple[float, ...]  # per group
    balanced: tuple[int, ...]  # microbatches per group
    even: tuple[int, ...]
    sync_seconds: float  # the gradient sum between groups
    peak_bytes: tuple[float, ...]  # per group, balanced shares
    fits: bool
    measured: bool  # shares from a calibration run

    def plan(self, rows: int) -> ParallelPlan:
        """The run's plan: the within-group layout over the step's microbatches of `rows` rows,
        each group taking its balanced share."""
        return dataclasses.replace(self.candidate, microbatches=self.microbatches,
                                   groups=tuple(m * rows for m in self.balanced))

    def step_seconds(self, shares) -> float:
        return max(m * t for m, t in zip(shares, self.microbatch_seconds)) + self.sync_seconds


def balance(microbatches: int, seconds: tuple[float, ...]) -> tuple[int, ...]:
    """Microbatches per group minimizing the slowest group's time (each group at least one)."""
    shares = [1] * len(seconds)
    for _ in range(microbatches - len(seconds)):
        g = min(range(len(seconds)), key=lambda i: (shares[i] + 1) * seconds[i])
        shares[g] += 1
    return tuple(shares)


def read_calibration(path: str) -> dict[str, float]:
    """{device kind (lower case): seconds per token} from bench step JSON lines."""
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                kind, seconds = row["device_kind"], float(row["step_time_s"])
                tokens = int(row["global_batch"]) * int(row["seq_len"])
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{n}: not a `bench step --json` row with device_kind, step_time_s, "
                                 f"global_batch and seq_len ({e})") from None
            out[kind.lower()] = min(out.get(kind.lower(), math.inf), seconds / tokens)
    return out


def _measured(calibration: dict[str, float], kind: str) -> float | None:
    matches = [k for k in calibration if kind.replace(" ", "").lower() in k.replace(" ", "")]
    return min((calibration[k] for k in matches), default=None)


def plan_groups(workload: Workload, cluster: Cluster, links: LinkTable, *, remats, host_optimizer: bool,
                calibration: str | None = None) -> list[GroupPlan]:
    """Every within-group layout x step microbatch count, with balanced and even shares, fastest
    fitting first."""
    sizes = {g.devices for g in cluster.groups}
    if len(sizes) != 1:
        raise ClusterError(f"data parallelism across groups needs groups of equal device counts, got "
                           f"{', '.join(f'{g.name}: {g.devices}' for g in cluster.groups)}")
    n, groups = cluster.groups[0].devices, cluster.groups
    measured = read_calibration(calibration) if calibration else {}
    between = cluster.inter_group_gbps or min(g.spec.inter_node_gbps for g in groups)
    out = []
    for count in (len(groups) * k for k in (1, 2, 4, 8)):
        if workload.global_batch % count:
            continue
        rows = workload.global_batch // count
        micro = dataclasses.replace(workload, global_batch=rows)
        planners = [Planner(micro, g, LinkTable(g.spec.intra_node_gbps, g.spec.inter_node_gbps, between,
                                                source=links.source)) for g in groups]
        for c in candidates(n, devices_per_node=min(g.spec.devices_per_node for g in groups),
                            layers=planners[0].layers, seq_len=workload.seq_len, global_batch=rows,
                            has_experts=planners[0].has_experts, remats=remats, host_optimizer=host_optimizer):
            if c.mesh.pipeline > 1 or c.microbatches > 1:
                continue  # one microbatch per program call; the pipeline stays within one program
            evaluations = [p.evaluate(c) for p in planners]
            if not all(e.ok for e in evaluations):
                continue
            seconds = []
            for g, e in zip(groups, evaluations):
                per_token = _measured(measured, g.spec.kind)
                seconds.append(per_token * rows * workload.seq_len if per_token else e.time.total)
            balanced = balance(count, tuple(seconds))
            even = (count // len(groups),) * len(groups)
            grads = sum(leaf.optimizer_bytes_per_device for leaf in planners[0].state(c).leaves)
            sync = planners[0].links.seconds(BETWEEN_GROUPS, 2 * (len(groups) - 1) / len(groups) * grads)
            peaks = []
            for p, m in zip(planners, balanced):
                accumulate = dataclasses.replace(c, microbatches=m)
                peaks.append(p.memory(accumulate, p.state(c), global_batch=rows * m).peak * (1 + p.margin))
            fits = all(peak <= p.budget for peak, p in zip(peaks, planners))
            out.append(GroupPlan(c, count, tuple(seconds), balanced, even, sync, tuple(peaks), fits,
                                 bool(measured)))
    out.sort(key=lambda gp: (not gp.fits, gp.step_seconds(gp.balanced)))
    return out


def plan_mixed(workload: Workload, cluster: Cluster, links: LinkTable, *, remats, host_optimizer: bool,
               calibration: str | None, top: int) -> str:
    plans = plan_groups(workload, cluster, links, remats=remats, host_optimizer=host_optimizer,
                        calibration=calibration)
    if not plans:
        raise NoLayoutFits("no within-group layout can run this model and batch on every group")
    best = plans[0]
    if not best.fits:
        worst = max(best.peak_bytes)
        raise NoLayoutFits(f"no layout fits every group: the best needs {worst / GIB:.1f} GiB per device on some group "
                           f"(claim: predicted peak + margin)")
    names = [g.name for g in cluster.groups]
    source = "measured (calibration)" if best.measured else "predicted"
    lines = [f"# mixed cluster: {cluster.describe()}; {len(plans)} within-group layouts x step microbatch counts, "
             f"{sum(p.fits for p in plans)} fit every group; group speeds {source}",
             f"{'#':>3}  {'within-group layout':<48} {'remat':<13} {'M':>3} {'rows/mb':>7} "
             f"{'balanced shares':<18} {'step s':>7} {'even step s':>11} {'gain':>6} {'peak GiB':>16}"]
    for i, gp in enumerate((p for p in plans if p.fits), 1):
        if i > top:
            break
        rows = workload.global_batch // gp.microbatches
        shares = "/".join(str(m * rows) for m in gp.balanced)
        lines.append(f"{i:>3}  {gp.candidate.label(omit=('remat',)):<48} {gp.candidate.remat:<13} "
                     f"{gp.microbatches:>3} {rows:>7} {shares:<18} {gp.step_seconds(gp.balanced):>7.3f} "
                     f"{gp.step_seconds(gp.even):>11.3f} {gp.step_seconds(gp.even) / gp.step_seconds(gp.balanced):>5.2f}x "
                     f"{'/'.join(f'{p / GIB:.0f}' for p in gp.peak_bytes):>16}")
    rows = workload.global_batch // best.microbatches
    per_stage = max(best.microbatch_seconds) / len(cluster.groups)
    ticks = best.microbatches + len(cluster.groups) - 1
    lines += [
        "",
        f"# the best, per group ({', '.join(names)}): one microbatch of {rows} rows takes "
        + ", ".join(f"{1e3 * t:.0f} ms" for t in best.microbatch_seconds)
        + f"; gradients summed between groups in {1e3 * best.sync_seconds:.0f} ms",
        f"#   balanced shares {tuple(m * rows for m in best.balanced)} rows: step {best.step_seconds(best.balanced):.3f} s;"
        f" even shares {tuple(m * rows for m in best.even)}: {best.step_seconds(best.even):.3f} s",
        f"#   pipeline across the groups (one stage per group, {best.microbatches} microbatches): about "
        f"{ticks * per_stage:.3f} s — every tick waits for the slower stage, and the one-program pipeline cannot "
        f"give that stage fewer layers without padding slots that cost the same time, so data-parallel balance "
        f"is the choice",
        "", "# gin bindings:",
        # the whole plan: the within-group layout, the step's microbatches, remat and each group's rows
        f'Experiment.layout = "{best.plan(rows).spec()}"',
    ]
    return "\n".join(lines)
