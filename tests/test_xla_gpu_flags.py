"""The CLIs' recommended XLA GPU flags (jaxtrain/xla_gpu_flags.py): added for a GPU platform and
never on CPU, turned off by JAXTRAIN_XLA_GPU_FLAGS=0, only flags the installed jaxlib names,
never over a flag the user set, and printed. Decided from the environment alone (no GPU here)."""
import pytest

from jaxtrain import xla_gpu_flags as g

pytestmark = [pytest.mark.fast]

ALL = {name for name, _, _ in g.RECOMMENDED}


def test_the_flags_are_added_for_a_gpu_platform_and_never_on_cpu():
    flags = g.gpu_flags("gpu", env={}, known=ALL)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert len(flags) == len(g.RECOMMENDED) and all(f.startswith("--xla_gpu_") for f in flags)
    for platform in ("cpu", "tpu"):
        assert g.gpu_flags(platform, env={}, known=ALL) == []
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=16"}
    assert g.apply_gpu_flags(env=env, platform="cpu", log=lambda line: None) == []
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=16"


def test_the_platform_is_read_from_the_environment_before_jax_starts():
    assert g.detect_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"
    assert g.detect_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert g.detect_platform({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    # this machine: no CUDA plugin or no NVIDIA device -> cpu, and the suite's runs get no flags
    assert g.detect_platform({}) == "cpu"


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_the_opt_out_turns_them_all_off(value):
    lines = []
    env = {g.OPT_OUT: value}
    assert g.apply_gpu_flags(env=env, platform="gpu", log=lines.append) == []
    assert "XLA_FLAGS" not in env and lines == [f"jaxtrain: XLA GPU flags off ({g.OPT_OUT}=0)"]


def test_only_flags_the_installed_jaxlib_names_are_added(tmp_path):
    known = {"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_reduce_combine_threshold_bytes"}
    flags = g.gpu_flags("gpu", env={}, known=known)
    assert sorted(f.split("=")[0][2:] for f in flags) == sorted(known)
    # the filter reads libraries' bytes: a fake library naming one flag knows only that one
    lib = tmp_path / "libfake.so"
    # a registered flag is a C string of its own; a removed one may remain as a reserved field
    # name in the options proto's descriptor (length-prefixed, no NUL around it)
    lib.write_bytes(b"\0xla_gpu_enable_latency_hiding_scheduler\0 xla_gpu_enable_pipelined_all_gathe\0"
                    b"R\x1bxla_gpu_enable_while_loop_double_bufferingR\x17")
    assert g.known_flags(ALL, files=[str(lib)]) == {"xla_gpu_enable_latency_hiding_scheduler"}
    # and the installed jaxlib names the scheduler flag but not an invented one
    real = g.known_flags({"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_no_such_flag_jaxtrain"})
    assert real == {"xla_gpu_enable_latency_hiding_scheduler"}


def test_a_flag_the_user_set_wins_and_the_set_is_printed():
    lines = []
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    flags = g.apply_gpu_flags(env=env, platform="gpu", log=lines.append)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags and flags
    assert env["XLA_FLAGS"].count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")
    assert len(lines) == 1 and lines[0].startswith("jaxtrain: XLA GPU flags") and " ".join(flags) in lines[0]
