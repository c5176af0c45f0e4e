"""Token embedding and the language-model head (tied to the embedding or not)."""
from __future__ import annotations

from flax import nnx

from jaxtrain.meshes.weight_gather import contract, lookup
from jaxtrain.models.layers.params import normal, param


class Embed(nnx.Module):
    def __init__(self, vocab: int, embed: int, *, rngs: nnx.Rngs, init_std: float = 0.02, dtype=None):
        self.dtype = dtype
        self.table = param(rngs, normal(init_std), (vocab, embed), ("vocab", "embed"))

    def __call__(self, tokens):
        # The lookup reads the table whole along `embed`, as a matmul reads an FSDP weight
        # gathered: rows looked up in an embed-split table come out embed-split, and XLA cannot
        # move them to the residual's batch/length split (nor the backward's gradient rows back)
        # without replicating them first ("involuntary full rematerialization", with
        # fsdp/zero1 under context or pipeline). Split over vocab only, the lookup is a masked
        # local gather summed over those axes.
        # (under `+gather_bf16` the bf16 copy is gathered: meshes/weight_gather.py)
        return lookup(self.table[...], tokens, self.dtype, ("vocab", "embed"))

    def attend(self, x):
        """Logits against the embedding table (tied head)."""
        return contract(x, self.table[...].T, 1, self.dtype, ("embed", "vocab"))


class LMHead(nnx.Module):
    def __init__(self, embed: int, vocab: int, *, rngs: nnx.Rngs, init_std: float = 0.02, dtype=None):
        self.dtype = dtype
        self.kernel = param(rngs, normal(init_std), (embed, vocab), ("embed", "vocab"))

    def __call__(self, x):
        return contract(x, self.kernel[...], 1, self.dtype, ("embed", "vocab"))
