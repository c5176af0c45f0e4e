# The bench flags of a tiny DeepSeek (MLA, 8 routed + 2 shared experts, bf16, remat full) and its
# two layouts, FSDP-16 and the 4-axis data x tensor x context x expert, sourced by
# benchmarks/step_ab.sh, step_abba.sh and step_before_after.sh. Reads STEPS.
FLAGS=(--gin_file=configs/deepseek_v2_tiny.gin --steps "$STEPS"
  --gin_param=DeepSeekConfig.vocab_size=1024 --gin_param=DeepSeekConfig.embed=256 --gin_param=DeepSeekConfig.layers=4
  --gin_param=DeepSeekConfig.first_k_dense=1 --gin_param=DeepSeekConfig.heads=16 --gin_param=DeepSeekConfig.q_lora_rank=None
  --gin_param=DeepSeekConfig.kv_lora_rank=512 --gin_param=DeepSeekConfig.qk_nope_head_dim=128
  --gin_param=DeepSeekConfig.qk_rope_head_dim=64 --gin_param=DeepSeekConfig.v_head_dim=128 --gin_param=DeepSeekConfig.mlp=1024
  --gin_param=DeepSeekConfig.expert_mlp=256 --gin_param=DeepSeekConfig.shared_experts=2
  '--gin_param=DeepSeekConfig.dtype="bfloat16"' '--gin_param=DeepSeekConfig.remat="full"'
  '--gin_param=DeepSeekConfig.rope_scaling=@YarnScaling()' --gin_param=YarnScaling.factor=40.0
  --gin_param=YarnScaling.original_max_position=4096
  --gin_param=RouterConfig.num_experts=8 --gin_param=RouterConfig.top_k=2 --gin_param=RouterConfig.aux_loss_weight=0.0
  --gin_param=TrainConfig.global_batch=16 --gin_param=TrainConfig.seq_len=256)
FSDP=data=16,rules=fsdp
AXES4=data=2,tensor=2,context=2,expert=2,rules=fsdp+expert_tp
