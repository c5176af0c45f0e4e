"""The suite runs on 16 simulated CPU devices; XLA reads the flags when jax starts. The
compile-speed flags and why they change no result: tests/xla_flags.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xla_flags import COMPILE_FLAGS, DEVICE_COUNT  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DEVICE_COUNT, COMPILE_FLAGS,
                                    # a loaded 2-core machine can leave simulated devices' threads >40 s
                                    # apart at a collective (XLA:CPU's default abort), seen once
                                    "--xla_cpu_collective_call_terminate_timeout_seconds=600"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

# `make test-fast` (pytest -m fast): the modules that check one piece on tiny inputs — meshes,
# rules, data, HF mappings, kernels against their references, layers, the resilience parts —
# for the edit-test loop (under 3 minutes); `make test` runs everything.
FAST_MODULES = {
    "test_mesh", "test_strict_rules", "test_data", "test_hf_config", "test_hf_mapping", "test_hf_errors",
    "test_hlo_stats",
    "test_pipeline_split", "test_ports", "test_resilience_parts", "test_mla", "test_latent_attention",
    "test_context_ring",
    "test_expert_exchange", "test_packing_attention", "test_moe", "test_mamba2", "test_bench_collectives",
    "test_kernels_causal_conv1d", "test_kernels_moe_routing", "test_kernels_grouped_matmul",
    "test_kernels_ssd_scan", "test_kernels_flash_attention", "test_kernels_flash_attention_pallas",
    "test_parallel_plan", "test_aux_outputs", "test_model_families", "test_grouped_matmul_tiled",
    "test_fsdp_coverage", "test_optimizer_roles", "test_planner",
    "test_blend", "test_data_sources", "test_token_store", "test_megatron_indexed", "test_prepare",
}


# Tests that start several jax processes on localhost (jax.distributed, gloo collectives): whole
# modules, or single tests by name.
MULTIPROCESS = {"test_multihost", "test_peer_faults", "test_stops", "test_startup_stops",
                "test_cli_across_two_processes", "test_one_group_per_process_trains_as_one_process"}

# Modules (or single tests, by name) outside tests/faults/ that start real processes of the CLIs,
# scripts or a Jupyter kernel (besides MULTIPROCESS).
END_TO_END = {"test_gpu_check", "test_cli", "test_profiling", "test_notebook",
              "test_cli_table_json_and_plot_on_16_devices", "test_cli_exit_codes_and_a_killed_prepare"}


# Process-level runs whose unit-level twins stay in `make test`: fault injections that each start
# one to four CLI runs (hangs in every phase of a run, signals during start-up, resumes under a
# changed optimizer), and the GPU check's dry run, the profiler and the notebook (a script, a
# trace, a Jupyter kernel). They keep `make test` under 15 minutes on two cores (it measured 17:19
# with them) by running in their own lane, `make test-extended` (marker `extended`), which CI runs
# after the suite.
EXTENDED = {"test_hang_phases", "test_startup_stops", "test_gpu_check", "test_profiling", "test_notebook",
            "test_resume_with_other_clipping_and_roles_carries_the_optimizer_state_over_with_one_line_each",
            "test_resume_with_an_optimizer_of_another_structure_is_refused_and_moves_nothing",
            "test_a_step_without_manifest_is_refused_unless_allowed"}


def pytest_collection_modifyitems(config, items):
    """Markers by module: `fast` (FAST_MODULES, `make test-fast`), `slow` (everything else),
    `multiprocess` (MULTIPROCESS), `end_to_end` (the fault injections of tests/faults/, the
    multi-process runs, the GPU check's dry run, the CLI, profiler and notebook runs: each starts
    real processes of the CLIs, scripts or a Jupyter kernel; `make test-e2e` runs only them),
    `gpu` (the kernel tests, which benchmarks/gpu_check.sh runs natively on a GPU; on CPU they
    run the kernels interpreted)."""
    import pytest
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        item.add_marker(pytest.mark.fast if module in FAST_MODULES else pytest.mark.slow)
        if module in MULTIPROCESS or item.originalname in MULTIPROCESS:
            item.add_marker(pytest.mark.multiprocess)
            item.add_marker(pytest.mark.end_to_end)
        if "faults" in item.path.parts or module in END_TO_END or item.originalname in END_TO_END:
            item.add_marker(pytest.mark.end_to_end)
        if module in EXTENDED or item.originalname in EXTENDED:
            item.add_marker(pytest.mark.extended)
        if module.startswith("test_kernels_"):
            item.add_marker(pytest.mark.gpu)
