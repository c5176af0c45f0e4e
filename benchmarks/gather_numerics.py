"""Which weight gradients of a bf16 model under FSDP are closer to float32 ones: the weight
cast where it is used (`fsdp+cast_where_used`: the matmul's bf16 weight gradient, reduced as
bf16) or cast then gathered (`fsdp+gather_bf16`: bf16 operands, float32 weight gradient,
reduced in float32; meshes/weight_gather.py).

    python benchmarks/gather_numerics.py [--seeds 100 101]    (from the repository root)

For a small Llama and a small DeepSeek (MLA, routed experts) in bfloat16, one batch's weight
gradients on 16 simulated devices (`data=16`) under each strategy, against the same model and
parameters computed in float32 on one device. Prints, per model and batch, the relative L2
error of all weight gradients together, the median of the per-leaf errors, and how many
leaves are closer under each; and a bf16 one-device run for scale. XLA:CPU widens bf16
collectives to float32 after partitioning, so on CPU the difference is the matmul's bf16
weight-gradient output alone; a GPU's bf16 reduction rounds each hop of its ring as well.
Sets its own simulated device count: run it as a script.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[100, 101])
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.training.config import TrainConfig
    from jaxtrain.training.optim import OptimizerConfig
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.step import loss_tokens
    from jaxtrain.training.train_setup import build_train_setup
    from jaxtrain.meshes.mesh import MeshConfig
    from jaxtrain.meshes.rules import use_rules
    from jaxtrain.models.deepseek import DeepSeekConfig
    from jaxtrain.models.layers.router import RouterConfig
    from jaxtrain.models.llama import LlamaConfig
    from helpers import random_packed_batch  # the suite's packed rows (1-3 documents each)

    jax.config.update("jax_threefry_partitionable", True)
    train = TrainConfig(global_batch=32, seq_len=64)
    models = {
        "llama": LlamaConfig(vocab_size=256, embed=128, layers=2, heads=4, kv_heads=4, mlp=256, dtype="bfloat16"),
        "deepseek": DeepSeekConfig(vocab_size=96, embed=32, layers=3, first_k_dense=1, heads=4, q_lora_rank=None,
                                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mlp=64,
                                   expert_mlp=16, shared_experts=1, router=RouterConfig(num_experts=16, top_k=2),
                                   dtype="bfloat16"),
    }

    def gradients(model, mesh, rules, params, host):
        setup = build_train_setup(model, ParallelPlan(mesh=mesh, rules=rules), train, OptimizerConfig(),
                                  jax.devices()[:mesh.data])
        state, batch = setup.state_from_params(params), setup.device_batch(host)

        def grad(p, b):
            with use_rules(setup.mesh, setup.rules):
                return setup.gradients(p, b, loss_tokens(b["loss_mask"].sum()))[0]
        return [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.device_get(jax.jit(grad)(state.params, batch)))]

    def errors(grads, reference):
        total = np.sqrt(sum(np.sum((g - r) ** 2) for g, r in zip(grads, reference))
                        / sum(np.sum(r ** 2) for r in reference))
        per_leaf = [np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30) for g, r in zip(grads, reference)]
        return total, np.asarray(per_leaf)

    for name, model in models.items():
        params = jax.device_get(jax.jit(lambda key: nnx.to_pure_dict(nnx.state(model.build(nnx.Rngs(params=key)))))(
            jax.random.key(0)))
        for seed in args.seeds:
            host = random_packed_batch(seed, train.global_batch, train.seq_len, model.vocab_size)
            reference = gradients(dataclasses.replace(model, dtype="float32"), MeshConfig(data=1), "dp", params, host)
            runs = {rules: errors(gradients(model, MeshConfig(data=16), rules, params, host), reference)
                    for rules in ("fsdp+cast_where_used", "fsdp+gather_bf16")}
            one_device = errors(gradients(model, MeshConfig(data=1), "dp", params, host), reference)[0]
            (where_total, where_leaf), (then_total, then_leaf) = runs.values()
            print(f"{name}, batch {seed}: relative L2 error vs float32 on one device: cast_where_used {where_total:.3e}, "
                  f"gather_bf16 {then_total:.3e} (bf16 on one device {one_device:.3e}); per-leaf median "
                  f"{np.median(where_leaf):.3e} vs {np.median(then_leaf):.3e}; leaves closer under gather_bf16: "
                  f"{int((then_leaf < where_leaf).sum())} of {len(then_leaf)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
