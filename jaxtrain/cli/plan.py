"""`python -m jaxtrain.plan --gin_file=F (--device H100 --devices 16 | --cluster C.json) [...]`

Ranks the layouts of a model on a cluster by predicted step time among those that fit the
devices' memory (jaxtrain/planner/): per layout the state, temporaries and peak per device,
the memory it claims (peak + the model's error margin), the predicted step time, tokens per
second per device and MFU, and the collectives left on the critical path; then the gin
bindings of the best layouts. `--verify K` compiles the top K here (compile only, on simulated
CPU devices when there is no accelerator), prints predicted against compiled memory, and ranks
any layout whose compiled peak exceeds the memory it claimed last (marked "does not hold its
claim" with the compiled figure), before the gin bindings are printed.

A cluster of several device groups (mixed GPUs) is planned as data parallelism across the
groups with batch shares by speed (jaxtrain/planner/mixed.py), beside the even split and a
pipeline across the groups.

  --seq_len, --global_batch   override the gin config's TrainConfig values
  --links FILE                measured link figures (`python -m jaxtrain.bench collectives --json`)
  --calibration FILE          measured step times per group (`python -m jaxtrain.bench step --json`)
  --remat a,b                 the remat policies to consider (default: none, dots_no_batch, full, offload_dots)
  --no_host_offload           leave out optimizer state in host memory
  --top N                     rows of the table (default 10)
  --json FILE                 every ranked layout as JSON lines
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxtrain import bundled
from jaxtrain.cli.launch import fail


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", action="append", default=[], type=bundled.gin_file,
                        help="gin config file, or a bundled config's name (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding 'X.y=z' (repeatable)")
    parser.add_argument("--cluster", default=None, help="cluster description (JSON; jaxtrain/planner/cluster.py)")
    parser.add_argument("--device", default=None, help="a built-in device kind: H100, H200, B200, A100, RTX PRO 6000")
    parser.add_argument("--devices", type=int, default=None, help="device count (with --device; checks --cluster)")
    parser.add_argument("--seq_len", type=int, default=None)
    parser.add_argument("--global_batch", type=int, default=None)
    parser.add_argument("--links", default=None, help="collectives-bench JSON lines: measured link bandwidths")
    parser.add_argument("--calibration", default=None, help="bench step JSON lines: measured group step times")
    parser.add_argument("--remat", default=None, help="remat policies to consider, comma-separated")
    parser.add_argument("--no_host_offload", action="store_true")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--verify", type=int, default=0, help="compile the top K layouts and compare memory")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxtrain.planner.cluster import Cluster, ClusterError

    try:
        cluster = Cluster.from_args(cluster=args.cluster, device=args.device, devices=args.devices)
    except ClusterError as e:
        fail(str(e))
    if args.verify:
        from jaxtrain.cli.launch import simulate_cpu_devices
        simulate_cpu_devices(cluster.groups[0].devices)
    from jaxtrain.cli.launch import DEFAULT_GIN
    from jaxtrain.planner.candidates import REMAT_POLICIES, candidates
    from jaxtrain.planner.links import LinkTable
    from jaxtrain.planner.planner import NoLayoutFits, Planner, Workload, require_fit
    from jaxtrain.planner.report import gin_bindings, ranked_table, verify_table
    from jaxtrain.training.config import load_experiment, parse_gin

    try:
        parse_gin(args.gin_file or [DEFAULT_GIN], args.gin_param)
        exp = load_experiment()
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    train = dataclasses.replace(exp.train, **{k: v for k, v in (("seq_len", args.seq_len),
                                                              ("global_batch", args.global_batch)) if v})
    exp = dataclasses.replace(exp, train=train)
    remats = tuple(args.remat.split(",")) if args.remat else REMAT_POLICIES
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        fail(f"--remat {args.remat!r}: unknown {unknown}; choose from {', '.join(REMAT_POLICIES)}")
    workload = Workload(exp.model, train.global_batch, train.seq_len, exp.loss.loss_chunk, exp.optimizer)

    group = cluster.groups[0]
    links = LinkTable(group.spec.intra_node_gbps, group.spec.inter_node_gbps, cluster.inter_group_gbps)
    try:
        for path in filter(None, (args.links, cluster.links_file)):
            links = links.with_measurements(path, group.spec.devices_per_node)
    except (OSError, ValueError) as e:
        fail(str(e))
    print(f"# {type(exp.model).__name__} ({exp.model.param_count() / 1e9:.2f}B parameters, "
          f"{exp.model.param_count(active_only=True) / 1e9:.2f}B active), batch {train.global_batch} x {train.seq_len}; "
          f"cluster {cluster.describe()}; links {links.source}", flush=True)

    if cluster.mixed:
        from jaxtrain.planner.mixed import plan_mixed
        try:
            print(plan_mixed(workload, cluster, links, remats=remats, host_optimizer=not args.no_host_offload,
                             calibration=args.calibration, top=args.top))
        except (ValueError, NoLayoutFits) as e:
            fail(str(e))
        return 0

    planner = Planner(workload, group, links)
    ranked = planner.rank(candidates(group.devices, devices_per_node=group.spec.devices_per_node,
                                     layers=planner.layers, seq_len=train.seq_len, global_batch=train.global_batch,
                                     has_experts=planner.has_experts, remats=remats,
                                     host_optimizer=not args.no_host_offload))
    try:
        require_fit(ranked, planner)
    except NoLayoutFits as e:
        fail(str(e))
    fitting = sum(e.fits for e in ranked)
    print(f"# {len(ranked)} layouts can run, {fitting} fit {group.spec.kind}'s {planner.budget / 2**30:.1f} GiB usable "
          f"(claim = predicted peak + {planner.margin:.0%}); {sum(planner.refused.values())} refused by the "
          f"layout rules; matmul efficiency {planner.efficiency.matmul:.0%} of peak assumed", flush=True)
    print(ranked_table(ranked, args.top))
    verified = []
    if args.verify:
        from jaxtrain.planner.verify import compiled_memory, compiling_platform, rerank_verified, verify_top
        platform = compiling_platform()
        verified = verify_top(ranked, planner, args.verify, lambda c: compiled_memory(exp, c), platform)
        print(f"\n# verify: the top {args.verify} compiled here ({platform.name} memory model beside XLA's figures)")
        print(verify_table(verified))
        ranked = rerank_verified(ranked, verified)
        broken = [v for v in verified if not v.holds_claim]
        if broken:
            print(f"\n# {len(broken)} of the verified layouts do not hold their claim and are ranked last; "
                  f"the ranking after verifying:")
            print(ranked_table(ranked, args.top))
    print("\n# gin bindings of the best three:")
    for i, e in enumerate(ranked[:3], 1):
        if e.fits:
            print(f"# {i}\n{gin_bindings(e)}")
    if args.json:
        checked = {id(v.evaluation): v for v in verified}
        with open(args.json, "w") as f:
            for e in ranked:
                f.write(json.dumps(evaluation_record(e, checked.get(id(e)))) + "\n")
    if any("error" in v.compiled for v in verified):
        return 1
    return 0


def evaluation_record(e, verified=None) -> dict:
    """`verified`: the layout's verify.Verified when `--verify` compiled it."""
    m, t = e.memory, e.time
    gib = 2 ** 30
    record = {"layout": e.candidate.spec(), "remat": e.candidate.remat, "fits": e.fits,
            "params_gib": m.params / gib, "optimizer_gib": m.optimizer / gib, "optimizer_host_gib": m.optimizer_host / gib,
            "gradients_gib": m.gradients / gib, "saved_activations_gib": m.saved_activations / gib,
            "host_activations_gib": m.host_activations / gib,
            "arguments_gib": m.arguments / gib, "temp_gib": m.temp / gib, "peak_gib": m.peak / gib,
            "claimed_gib": e.claimed_bytes / gib, "step_s": t.total, "compute_s": t.compute,
            "tokens_per_sec_per_device": e.tokens_per_sec_per_device, "mfu": e.mfu,
            "collectives_s": t.by_kind, "bubble_s": t.bubble}
    if verified is not None:
        record["verified"] = {"holds_claim": verified.holds_claim, "claim_gib": verified.claim_gb,
                              **{k: v for k, v in verified.compiled.items()}}
    return record


if __name__ == "__main__":
    sys.exit(main())
