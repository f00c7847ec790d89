"""The models `ddpx-bench train` times DDP's steps on (and tools/gpu_report.py, on a GPU): an MLP
of a chosen size, and a GPT-2-style decoder for a step whose compute is a transformer's."""

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP"]


class MLP(nn.Sequential):
    """`depth` Linear(width, width) layers with ReLU between: (batch, width) -> (batch, width).

    It has depth * (width**2 + width) parameters: `MLP.with_params(25_000_000)` has width 2040
    and depth 6 (24.98M parameters).
    """

    def __init__(self, width: int, depth: int):
        layers = [nn.Linear(width, width)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(), nn.Linear(width, width)]
        super().__init__(*layers)
        self.width = width

    @classmethod
    def with_params(cls, n_params: int, depth: int = 6) -> "MLP":
        """The MLP of `depth` layers with about `n_params` parameters (width a multiple of 8)."""
        width = max(8, round(math.sqrt(n_params / depth) / 8) * 8)
        return cls(width, depth)


class _Block(nn.Module):
    """GPT-2's block: pre-LayerNorm causal self-attention, then a 4x MLP, each around a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, `depth` blocks, a final LayerNorm and
    an output layer tied to the token embedding: (batch, tokens) of ids -> (batch, tokens, vocab).

    It has about (vocab + context) * width + depth * 12 * width**2 parameters:
    `GPT.with_params(25_000_000)` has width 512 and depth 7 (26.3M parameters).
    """

    def __init__(self, width: int = 512, depth: int = 6, heads: int = 8, vocab: int = 8192,
                 context: int = 128):
        super().__init__()
        self.vocab, self.context = vocab, context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        # GPT-2's initialization of the embeddings: with nn.Embedding's N(0, 1), the tied output
        # layer's logits start with a standard deviation near sqrt(width), and the loss far above
        # ln(vocab), where a model that knows nothing starts.
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)

    @classmethod
    def with_params(cls, n_params: int, width: int = 512, vocab: int = 8192) -> "GPT":
        """The GPT of this width with about `n_params` parameters (at least one block)."""
        depth = max(1, round((n_params - vocab * width) / (12 * width * width)))
        return cls(width, depth, vocab=vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)
        for block in self.blocks:
            x = block(x, causal)
        return self.ln(x) @ self.tokens.weight.t()

    @staticmethod
    def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each position's logits against the next id, over the batch."""
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
