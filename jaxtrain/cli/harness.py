"""`python -m jaxtrain.harness run --model jaxtrain --model_args workdir=W[,layout=...] --tasks ...`:
the harness's own command line (every flag of `lm_eval run`), with the `jaxtrain` model registered.
Simulated CPU devices are sized from `layout=` (or the workdir's run) before jax starts."""
import sys

from jaxtrain.cli.launch import simulate_cpu_devices, simulate_devices_if_needed


def _model_args(argv) -> dict:
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--model_args" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--model_args=") else None)
        if value is not None:
            return dict(item.split("=", 1) for item in value.replace(" ", ",").split(",") if "=" in item)
    return {}


def size_devices(argv) -> None:
    """Before jax starts: the devices `layout=` (or the workdir's own layout) asks for."""
    import os

    from jaxtrain.training.parallel_plan import ParallelPlan

    args = _model_args(argv)
    if args.get("layout"):
        try:
            simulate_cpu_devices(ParallelPlan.parse(args["layout"].replace(":", ",")).device_count())
        except ValueError as e:
            sys.exit(f"error: layout: {e}")
    elif args.get("workdir"):
        simulate_devices_if_needed([os.path.join(args["workdir"], "config.gin")], [], 1)


def main() -> None:
    size_devices(sys.argv[1:])
    from lm_eval.__main__ import cli_evaluate

    import jaxtrain.harness.lm  # noqa: F401  registers the `jaxtrain` model

    cli_evaluate()


if __name__ == "__main__":
    main()
