"""Convert between Hugging Face model directories and jaxtrain checkpoints, a layer at a time.

    python -m jaxtrain.convert --hf_dir=HF_DIR --workdir=W
        HF -> W/checkpoints/0 (parameters only) + W/config.gin describing the model; then
        python -m jaxtrain.train --gin_file=W/config.gin [--gin_file=...] --workdir=W fine-tunes it.
    python -m jaxtrain.convert --workdir=W --hf_out=OUT [--step=N] [--hf_dtype=bfloat16]
        the latest (or given) checkpoint in W -> an HF directory transformers loads.
    python -m jaxtrain.convert --workdir=W --hf_adapter_out=OUT [--hf_base=NAME]
        a LoRA run's adapters -> a peft adapter directory (PeftModel.from_pretrained(base, OUT)).
    python -m jaxtrain.convert --workdir=W --hf_out=OUT --merge_adapters
        a LoRA run with its adapters merged into the base's weights -> an HF directory.
    python -m jaxtrain.convert --hf_adapter_dir=ADAPTER --lora_base=B --workdir=W
        a peft adapter directory -> W/checkpoints/0 (adapters on the base converted in B) and
        W/config.gin; python -m jaxtrain.train --gin_file=W/config.gin --workdir=W trains them on.

Neither direction builds the model in host memory: tensors are read, rearranged and written
one layer at a time. The peak resident memory is printed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys

from jaxtrain import bundled

DEFAULT_STEP = 0


def _steps(checkpoints: str) -> list[int]:
    """The steps in a checkpoint directory, oldest first (none when it does not exist)."""
    return sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit()) if os.path.isdir(checkpoints) else []


def _fresh(checkpoints: str, what: str) -> None:
    """FileExistsError when `checkpoints` already holds steps: an import writes a fresh workdir."""
    existing = _steps(checkpoints)
    if existing:
        raise FileExistsError(f"{checkpoints} already holds step(s) {[str(s) for s in existing]}; {what} into a "
                              f"fresh workdir so nothing there is overwritten")


def hf_to_checkpoint(hf_dir: str, workdir: str) -> str:
    """Writes W/checkpoints/0 and W/config.gin; returns the config.gin path."""
    from jaxtrain.hf.checkpoint_streaming import StreamedArray, save_streamed_params
    from jaxtrain.hf.gin_config import model_gin
    from jaxtrain.hf.loading import import_plan
    from jaxtrain.hf.plan import BLOCK_BYTES
    from jaxtrain.hf.trees import unflatten

    plan = import_plan(hf_dir)  # checks config and tensors before the workdir is touched
    checkpoints = os.path.join(workdir, "checkpoints")
    _fresh(checkpoints, "convert")

    def streamed(leaf):
        block_shape, regions = leaf.blocks(BLOCK_BYTES)
        blocks = lambda: ((region, plan.read_region(leaf.path, region)) for region in regions)
        return StreamedArray(leaf.shape, leaf.dtype, block_shape, blocks)

    params = unflatten({path: streamed(leaf) for path, leaf in plan.leaves.items()})
    save_streamed_params(checkpoints, DEFAULT_STEP, params)
    hf_dir = os.path.abspath(hf_dir)
    extra = []
    if any(os.path.exists(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        extra.append(f"DataConfig.tokenizer = {hf_dir!r}")
    header = (f"Converted by `python -m jaxtrain.convert` from {hf_dir} (model_type {plan.family.model_type}).\n"
              f"The parameters are in checkpoints/{DEFAULT_STEP}; training resumes from them with a fresh "
              f"optimizer:\n  python -m jaxtrain.train --gin_file=<this file> [--gin_file=...] --workdir=<this dir>")
    gin_path = os.path.join(workdir, "config.gin")
    with open(gin_path, "w") as f:
        f.write(model_gin(plan.config, header, extra))
    return gin_path


def model_config_from_gin(gin_files, gin_params=()):
    import gin
    from jaxtrain.training.config import Experiment, parse_gin

    for path in gin_files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"gin file not found: {path}")
    gin.clear_config()
    parse_gin(gin_files, gin_params)
    model = Experiment().model
    if model is None:
        raise ValueError(f"{', '.join(gin_files)} bind no model (Experiment.model)")
    return model


def checkpoint_to_hf(workdir: str, hf_out: str, *, step: int | None = None, gin_files=(), gin_params=(),
                     hf_dtype: str | None = None, max_shard_bytes: int | None = None) -> int:
    """Writes the checkpoint at `step` (default: latest) of W as an HF dir; returns the step."""
    from flax import nnx

    from jaxtrain.hf.checkpoint_streaming import CheckpointSource
    from jaxtrain.hf.exporter import DEFAULT_MAX_SHARD_BYTES, ExportPlan, write_hf_dir
    from jaxtrain.hf.registry import family_for_config
    from jaxtrain.training.state import abstract_model

    config = model_config_from_gin(list(gin_files) or [os.path.join(workdir, "config.gin")], gin_params)
    if hasattr(config, "lora"):
        raise ValueError(f"{workdir} is a LoRA run: export it with --merge_adapters (a full model) or "
                         f"--hf_adapter_out (a peft adapter directory)")
    checkpoints = os.path.join(workdir, "checkpoints")
    steps = _steps(checkpoints)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {checkpoints}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"no step {step} in {checkpoints} (steps: {steps})")
    plan = ExportPlan(family_for_config(config), config, hf_dtype)
    source = CheckpointSource(checkpoints, step, nnx.to_pure_dict(abstract_model(config)[1]))
    write_hf_dir(plan, source, hf_out, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    return step


def _lora_run(workdir: str, step: int | None, gin_files, gin_params, what: str):
    """(model config with adapters, checkpoint directory, step) of a LoRA run's workdir; a run
    without adapters is a ValueError naming it (before anything is written)."""
    config = model_config_from_gin(list(gin_files) or [os.path.join(workdir, "config.gin")], gin_params)
    if not hasattr(config, "lora"):
        raise ValueError(f"{workdir} is not a LoRA run (its config binds no Experiment.lora): it has no adapters "
                         f"to {what}")
    checkpoints = os.path.join(workdir, "checkpoints")
    steps = _steps(checkpoints)
    step = steps[-1] if step is None and steps else step
    if step not in steps:
        raise FileNotFoundError(f"no step {step} in {checkpoints} (steps: {steps})" if steps
                                else f"no checkpoint in {checkpoints}")
    return config, checkpoints, step


def _read_params(config, checkpoints: str, step: int, adapters_only: bool) -> tuple[dict, dict]:
    """(host params of the step: the adapters alone, or with the base they were trained on; its manifest)."""
    import jax
    from flax import nnx

    from jaxtrain.checkpoints.checkpointer import Checkpointer
    from jaxtrain.checkpoints.adapter_base import split_tree
    from jaxtrain.training.state import abstract_model

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                            nnx.to_pure_dict(abstract_model(config)[1]))
    if adapters_only:
        keep = {p for p in _leaf_paths(abstract) if "/adapter/" in p}
        abstract, _ = split_tree(abstract, keep)
    checkpointer = Checkpointer(checkpoints, keep=None, async_save=False)
    try:
        params = checkpointer.restore(step, {"params": abstract})["params"]
        manifest = checkpointer.manifest(step) or {}
    finally:
        checkpointer.close()
    return jax.device_get(params), manifest


def _leaf_paths(tree) -> set[str]:
    from jaxtrain.hf.trees import flatten
    return set(flatten(tree))


def adapters_to_peft(workdir: str, out: str, *, step: int | None = None, gin_files=(), gin_params=(),
                     base_name: str | None = None) -> int:
    """Writes the adapters of a LoRA run's checkpoint `step` (default: latest) as a peft adapter
    directory; returns the step."""
    from jaxtrain.hf.adapters import peft_tensors, write_peft_dir
    from jaxtrain.hf.exporter import ExportPlan
    from jaxtrain.hf.registry import family_for_config

    config, checkpoints, step = _lora_run(workdir, step, gin_files, gin_params, "export")
    plan = ExportPlan(family_for_config(config.base), config.base, "float32")
    params, manifest = _read_params(config, checkpoints, step, adapters_only=True)
    tensors, modules = peft_tensors(plan, params)  # an unsupported mapping fails before anything is written
    recorded = manifest.get("base", {}).get("directory")
    base_name = base_name or (os.path.dirname(recorded) if recorded else workdir)
    write_peft_dir(out, tensors, modules, config.lora, base_name)
    return step


def merged_to_hf(workdir: str, out: str, *, step: int | None = None, gin_files=(), gin_params=(),
                 hf_dtype: str | None = None, max_shard_bytes: int | None = None) -> int:
    """Writes a LoRA run's checkpoint `step` (default: latest) with the adapters merged into the
    base's weights, as an HF model directory of the base's architecture; returns the step."""
    from jaxtrain.hf.adapters import merged
    from jaxtrain.hf.exporter import DEFAULT_MAX_SHARD_BYTES, ExportPlan, write_hf_dir
    from jaxtrain.hf.registry import family_for_config
    from jaxtrain.hf.saving import ParamsSource

    config, checkpoints, step = _lora_run(workdir, step, gin_files, gin_params, "merge")
    plan = ExportPlan(family_for_config(config.base), config.base, hf_dtype)
    params, _ = _read_params(config, checkpoints, step, adapters_only=False)
    write_hf_dir(plan, ParamsSource(merged(params, config.lora.scale)), out,
                 max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    return step


def _adapter_shapes(config) -> dict[str, tuple[tuple, tuple]]:
    """{kernel path: (A's shape, B's shape)} of the adapters on single projections in `config`'s model."""
    from flax import nnx

    from jaxtrain.hf.trees import flatten
    from jaxtrain.training.state import abstract_model

    flat = flatten(nnx.to_pure_dict(abstract_model(config)[1]))
    suffix = "/adapter/a"
    return {p[:-len(suffix)] + "/kernel": (tuple(flat[p].shape), tuple(flat[p[:-1] + "b"].shape))
            for p in flat if p.endswith(suffix)}


# peft adapter settings a plain LoRA on our targets reproduces: anything else is refused by name
_PEFT_PLAIN = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_dora": False}


def _read_peft_dir(adapter_dir: str) -> tuple[dict, dict]:
    """(adapter_config.json, {tensor name: array}) of a peft adapter directory."""
    import json

    from safetensors.numpy import load_file

    config_path = os.path.join(adapter_dir, "adapter_config.json")
    weights_path = os.path.join(adapter_dir, "adapter_model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{adapter_dir} is not a peft adapter directory: no {os.path.basename(path)}")
    with open(config_path) as f:
        config = json.load(f)
    for key, plain in _PEFT_PLAIN.items():
        if config.get(key, plain) != plain:
            raise ValueError(f"{config_path}: {key}={config[key]!r}; jaxtrain imports plain LoRA adapters "
                             f"({key}={plain!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "target_parameters"):
        if config.get(key):
            raise ValueError(f"{config_path}: {key}={config[key]!r} is not supported by the adapter import")
    return config, load_file(weights_path)


def peft_to_adapters(adapter_dir: str, workdir: str, base_workdir: str) -> str:
    """Writes a peft adapter directory as a LoRA run's first checkpoint, W/checkpoints/0 (the
    adapters, on the base converted in `base_workdir`), and W/config.gin (the base's model with
    the adapter's LoraConfig and Experiment.lora_base); returns the config.gin path. Training in
    W continues the adapters with a fresh optimizer."""
    import jax
    import gin

    from jaxtrain.checkpoints.adapter_base import AdapterCheckpoints
    from jaxtrain.checkpoints.checkpointer import CONVERTED, Checkpointer, base_record
    from jaxtrain.hf.adapters import PEFT_PREFIX, adapters_from_peft, peft_modules
    from jaxtrain.hf.exporter import ExportPlan
    from jaxtrain.hf.registry import family_for_config
    from jaxtrain.hf.trees import unflatten
    from jaxtrain.training.trained_params import SomeParams
    from jaxtrain.models.family import family_of
    from jaxtrain.models.lora import LoraConfig, with_lora

    peft_config, tensors = _read_peft_dir(adapter_dir)
    checkpoints = os.path.join(workdir, "checkpoints")
    _fresh(checkpoints, "import the adapters")
    base_gin = os.path.join(base_workdir, "config.gin")
    try:
        base_cfg = model_config_from_gin([base_gin])
    finally:
        gin.clear_config()
    if hasattr(base_cfg, "lora"):
        raise ValueError(f"{base_workdir} is a LoRA run; --lora_base names a converted base model's workdir")
    base = base_record(os.path.join(base_workdir, "checkpoints"), what="the base (--lora_base)")
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    if peft_config.get("lora_dropout"):
        print(f"note: {adapter_dir} was trained with lora_dropout={peft_config['lora_dropout']}; jaxtrain's adapters "
              f"train on without dropout", file=sys.stderr, flush=True)
    use_rslora = bool(peft_config.get("use_rslora", False))
    plan = ExportPlan(family_for_config(base_cfg), base_cfg, "float32")
    names = {k[len(PEFT_PREFIX):-len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    targets, placed = [], set()
    for target in dict(family_of(base_cfg).adapter_targets):  # which of our targets the file adapts
        try:
            shapes = _adapter_shapes(with_lora(base_cfg, LoraConfig(rank=rank, alpha=alpha, targets=(target,))))
            modules = set().union(*peft_modules(plan, shapes).values()) if shapes else set()
        except ValueError:  # the model lacks it, or its HF tensor is fused: not importable
            continue
        found = modules & names
        if modules and found == modules:
            targets.append(target)
            placed |= modules
        elif found:
            raise ValueError(f"{adapter_dir} adapts {len(found)} of the {len(modules)} modules of target {target!r} "
                             f"(e.g. {sorted(found)[0]}); jaxtrain's adapters cover all of a target's modules")
    unplaced = sorted(names - placed)
    if unplaced:
        raise ValueError(f"{adapter_dir} adapts {unplaced[0]}, which no importable target of model family "
                         f"{family_of(base_cfg).name!r} places ({len(unplaced)} such modules)")
    lora = LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets), use_rslora=use_rslora)
    shapes = _adapter_shapes(with_lora(base_cfg, lora))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = {}
    for kernel_path, (a, b) in adapters_from_peft(plan, shapes, tensors).items():
        prefix = kernel_path[:-len("kernel")] + "adapter/"
        flat[prefix + "a"], flat[prefix + "b"] = jax.device_put(a, one), jax.device_put(b, one)
    part = SomeParams(frozenset(tuple(p.split("/")) for p in flat))
    checkpointer = Checkpointer(checkpoints, keep=None, async_save=False, saves=AdapterCheckpoints(base, part))
    try:
        checkpointer.save(DEFAULT_STEP, {"params": unflatten(flat)}, extra={"kind": CONVERTED})
    finally:
        checkpointer.close()
    with open(base_gin) as f:
        model_lines = f.read()
    gin_path = os.path.join(workdir, "config.gin")
    with open(gin_path, "w") as f:
        f.write(f"# LoRA adapters imported by `python -m jaxtrain.convert` from {os.path.abspath(adapter_dir)} (peft),\n"
                f"# on the base model converted in {os.path.abspath(base_workdir)}; the base's config follows.\n"
                f"#   python -m jaxtrain.train --gin_file=<this file> [--gin_file=...] --workdir=<this dir>\n\n"
                f"{model_lines.rstrip()}\n\n"
                f"Experiment.lora = @LoraConfig()\nLoraConfig.rank = {rank}\nLoraConfig.alpha = {alpha!r}\n"
                f"LoraConfig.targets = {tuple(targets)!r}\nLoraConfig.use_rslora = {use_rslora}\n"
                f"Experiment.lora_base = {os.path.abspath(base_workdir)!r}\n")
    return gin_path


def peak_rss_mb() -> float:
    """This process's resident-memory high-water mark. VmHWM, where Linux has it, counts only
    this program; getrusage's maxrss also keeps whatever the launching process had at fork."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@contextlib.contextmanager
def _import_notes_shown():
    """The HF readers log one info line naming the config fields they accepted without using
    (provenance, generation settings): a user converting a published checkpoint should see it.
    The handler lives for this call only: left on the shared logger, it wrote to a stderr that a
    caller (pytest's capture, a notebook) had since closed, and added lines to other CLIs' output."""
    notes = logging.getLogger("jaxtrain.hf")
    handler, level = logging.StreamHandler(sys.stderr), notes.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    notes.addHandler(handler)
    notes.setLevel(logging.INFO)
    try:
        yield
    finally:
        notes.removeHandler(handler)
        notes.setLevel(level)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="jaxtrain workdir (checkpoints/ and config.gin)")
    parser.add_argument("--hf_dir", help="HF model directory to import")
    parser.add_argument("--hf_out", help="HF model directory to export to")
    parser.add_argument("--hf_adapter_out", help="peft adapter directory to export a LoRA run's adapters to")
    parser.add_argument("--hf_adapter_dir", help="peft adapter directory to import as a LoRA run (with --lora_base)")
    parser.add_argument("--lora_base", default=None, help="adapter import: the converted base model's workdir")
    parser.add_argument("--merge_adapters", action="store_true",
                        help="export (--hf_out): a LoRA run's adapters merged into the base's weights")
    parser.add_argument("--hf_base", default=None,
                        help="adapter export: base_model_name_or_path to record (default: the base's workdir)")
    parser.add_argument("--step", type=int, default=None, help="export this step instead of the latest")
    parser.add_argument("--gin_file", action="append", default=[], type=bundled.gin_file,
                        help="export: model gin, or a bundled config's name (default W/config.gin)")
    parser.add_argument("--gin_param", action="append", default=[], help="export: extra gin binding")
    parser.add_argument("--hf_dtype", default=None, help="export: weight dtype on disk (float32, bfloat16, float16)")
    parser.add_argument("--max_shard_gb", type=float, default=None, help="export: safetensors shard size")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.hf_dir, args.hf_out, args.hf_adapter_out, args.hf_adapter_dir))) != 1:
        parser.error("give exactly one of --hf_dir (import), --hf_out (export), --hf_adapter_out (adapter export) "
                     "or --hf_adapter_dir (adapter import)")
    if bool(args.hf_adapter_dir) != bool(args.lora_base):
        parser.error("--hf_adapter_dir (a peft adapter to import) and --lora_base (the base's workdir) go together")
    if args.merge_adapters and not args.hf_out:
        parser.error("--merge_adapters goes with --hf_out")

    with _import_notes_shown():
        return _convert(args)


def _convert(args) -> int:
    from jaxtrain.checkpoints.errors import CheckpointError
    from jaxtrain.hf.errors import HFCheckpointError, HFConfigError
    try:
        if args.hf_dir:
            gin_path = hf_to_checkpoint(args.hf_dir, args.workdir)
            print(f"wrote {os.path.join(args.workdir, 'checkpoints', str(DEFAULT_STEP))} and {gin_path}")
        elif args.hf_adapter_dir:
            gin_path = peft_to_adapters(args.hf_adapter_dir, args.workdir, args.lora_base)
            print(f"wrote {os.path.join(args.workdir, 'checkpoints', str(DEFAULT_STEP))} (adapters on {args.lora_base}) "
                  f"and {gin_path}")
        elif args.hf_adapter_out:
            step = adapters_to_peft(args.workdir, args.hf_adapter_out, step=args.step, gin_files=args.gin_file,
                                    gin_params=args.gin_param, base_name=args.hf_base)
            print(f"wrote the adapters of step {step} of {args.workdir} to {args.hf_adapter_out}")
        elif args.merge_adapters:
            max_bytes = int(args.max_shard_gb * 1e9) if args.max_shard_gb else None
            step = merged_to_hf(args.workdir, args.hf_out, step=args.step, gin_files=args.gin_file,
                                gin_params=args.gin_param, hf_dtype=args.hf_dtype, max_shard_bytes=max_bytes)
            print(f"wrote step {step} of {args.workdir}, adapters merged, to {args.hf_out}")
        else:
            max_bytes = int(args.max_shard_gb * 1e9) if args.max_shard_gb else None
            step = checkpoint_to_hf(args.workdir, args.hf_out, step=args.step, gin_files=args.gin_file,
                                    gin_params=args.gin_param, hf_dtype=args.hf_dtype, max_shard_bytes=max_bytes)
            print(f"wrote step {step} of {args.workdir} to {args.hf_out}")
    except (HFConfigError, HFCheckpointError, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"peak host memory (max RSS): {peak_rss_mb():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
