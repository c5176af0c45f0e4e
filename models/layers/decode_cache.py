"""The contract every layer kind keeps for generation: prefill a left-padded prompt, then decode
one token at a time against a preallocated, per-layer cache.

Left padding: a batch of prompts of different lengths is laid out right-aligned in [b, P], so
every row writes its next token at the same cache index; `valid_from[b]` (the row's pad count)
masks the keys before it, and each row's positions count from 0 at its first real token. Pad
tokens carry segment id 0 and real ones 1, so the training forward's packed-sequence masking
(attention) and state restarts (the SSD scan, the causal conv) already keep pads out of every
real token's result: prefill *is* the training forward, returning what it computed for the cache.

A layer kind's cache is a pytree of arrays with a leading batch axis, named with logical axes so
it shards like the weights (kv_heads / heads over `tensor`, batch over `data`):

- grouped-query attention: keys and values [b, max_len, kv_heads, head_dim];
- multi-head latent attention: the normalized latent [b, max_len, kv_lora] and the rotary key
  [b, max_len, qk_rope_head_dim] only (keys/values up-projections absorbed at decode time);
- Mamba-2: the SSM state [b, heads, head_dim, state] and the conv window's last
  conv_kernel - 1 inputs per conv (constant in max_len).

Methods a mixer (and so a layer) provides, beside its training `__call__`:

    init_cache(batch, max_len, dtype) -> cache          zeros, logically constrained
    prefill(x, positions, segment_ids, cache) -> (out, cache)
        x [b, P, embed], the prompt; writes cache entries [0, P)
    decode(x, positions, cache, index, valid_from) -> (out, cache)
        x [b, 1, embed], positions [b, 1]; writes entry `index` (a traced scalar, the same for
        every row) and attends to entries [valid_from[b], index]

Stacks thread caches as scan inputs/outputs stacked on the `layers` axis, like the weights.
"""
