"""A model family that exists only in the tests: Llama with a GELU MLP (transformers' Llama with
`hidden_act="gelu"`), served under its own architecture name through the model registry alone.

It is one module and one `register_model` line, as a new family should be: the loader, the GGUF
conversion, tensor parallelism and the engine are not told about it. Its MLP uses the package's
linear layers with their parallel roles, so it shards without code of its own. The class lives
in an importable module (not a test function) because tensor-parallel workers unpickle it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kubeinfer.server.model.config import ModelConfig
from kubeinfer.server.model.families.llama import LlamaForCausalLM
from kubeinfer.server.model.layers.attention import AttentionBackend
from kubeinfer.server.model.layers.mlp import SwiGLUMLP
from kubeinfer.server.model.registry import LLAMA_GGUF, ModelFamily

ARCHITECTURE = "toy_gelu_llama"


class GeluMLP(SwiGLUMLP):
    """down(gelu(gate(x)) * up(x)): the one part that differs from Llama (its projections, another
    activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate) * up)


class ToyGeluLlama(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        for layer in self.model.layers:
            layer.mlp = GeluMLP(config.hidden_size, config.intermediate_size)


TOY_FAMILY = ModelFamily(ToyGeluLlama, LLAMA_GGUF)
