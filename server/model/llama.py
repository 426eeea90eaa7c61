"""Llama-family causal LM over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5.

The variants differ only in config (q/k/v bias, tied lm_head, rope scaling), so one module
serves them all. Parameter names follow transformers' checkpoints (`model.layers.N...`), with
q/k/v and gate/up merged; `load_weights` routes checkpoint tensors into the merged matrices.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kubeinfer.kernels import ops, quant_linear_cpu
from kubeinfer.kernels.quant_linear_cpu import QuantizedWeight

from .attention import AttentionBackend
from .checkpoint import QuantizedBlocks
from .config import ModelConfig
from .forward_batch import ForwardBatch
from .linear import Linear, MergedLinear, can_pack, linear, pack_weight
from .mlp import SwiGLUMLP
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .self_attention import SelfAttention

# checkpoint projection name -> (merged module name, shard index)
PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, kv_cache, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                      bias=False)
        self.packed_tied_head: torch.Tensor | None = None
        self.quantized_tied_head: QuantizedWeight | None = None

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab_size]; writes this step's K/V into `kv_caches`."""
        x = self.model.embed_tokens(batch.input_ids)
        rotary = self.model.rotary_emb
        cos_sin = (rotary.table(self.config.max_position_embeddings) if ops.uses_triton(x)
                   else rotary.cos_sin(batch.positions, x.dtype))
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, batch)
        # Only the rows that need logits go through the final norm and the (large) lm_head.
        x = self.model.norm(x[batch.logits_indices] + residual[batch.logits_indices])
        if self.lm_head is not None:
            return self.lm_head(x).float()
        return linear(x, self.model.embed_tokens.weight, self.packed_tied_head,
                      quantized=self.quantized_tied_head).float()

    @torch.no_grad()
    def pack_weights(self) -> None:
        """Prepack every GEMM weight for oneDNN where that is faster (CPU bf16, see linear.py).
        Call once after `load_weights`: packed layers cannot be reloaded."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and self.packed_tied_head is None and can_pack(embedding):
            self.packed_tied_head = pack_weight(embedding)   # a copy: the embedding lookup needs the plain table

    @torch.no_grad()
    def quantize_weights(self, blocks: QuantizedBlocks) -> int:
        """Give every Linear (and the tied lm_head) the kernel form of its checkpoint matrices
        when all of them are in one type `quant_linear_cpu` reads; returns how many got one."""
        count = 0
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.quantized = _quantized([blocks.get(f"{source}.weight") for source in _sources(name, module)])
                count += module.quantized is not None
        if self.lm_head is None:
            self.quantized_tied_head = _quantized([blocks.get("model.embed_tokens.weight")])
            count += self.quantized_tied_head is not None
        return count

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) in, converting dtype; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name == "rope_freqs.weight":   # GGUF Llama 3.1+: per-frequency divisors
                self.model.rotary_emb.inv_freq.div_(tensor.to(self.model.rotary_emb.inv_freq))
                continue
            module_name, _, kind = name.rpartition(".")
            parent, _, proj = module_name.rpartition(".")
            if proj in PACKED_MODULES:
                merged, shard = PACKED_MODULES[proj]
                target = f"{parent}.{merged}.{kind}"
                param = self._param(params, target)
                self.get_submodule(f"{parent}.{merged}").load_shard(param, tensor, shard)
                loaded.add(f"{target}#{shard}")
                continue
            param = self._param(params, name)
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        missing = self._expected_weights() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:8])}")

    def _expected_weights(self) -> set[str]:
        """Parameter names, merged ones as `name#shard` (one entry per checkpoint matrix)."""
        expected = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            shards = len(module.output_sizes) if isinstance(module, MergedLinear) else 0
            expected.update([f"{name}#{i}" for i in range(shards)] if shards else [name])
        return expected

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for a Llama-family model")
        return params[name]


def _sources(name: str, module: Linear) -> list[str]:
    """The checkpoint modules a Linear holds: its own name, or a merged module's projections in shard order."""
    if not isinstance(module, MergedLinear):
        return [name]
    parent, _, merged = name.rpartition(".")
    shards = sorted((shard, proj) for proj, (target, shard) in PACKED_MODULES.items() if target == merged)
    return [f"{parent}.{proj}" for _, proj in shards]


def _quantized(parts: list[tuple[str, torch.Tensor] | None]) -> QuantizedWeight | None:
    """The kernel form of these row blocks stacked, if all are there, of one type, and packable."""
    if not parts or any(part is None for part in parts) or len({qtype for qtype, _ in parts}) > 1:
        return None
    qtype = parts[0][0]
    blocks = torch.cat([part[1] for part in parts]) if len(parts) > 1 else parts[0][1]
    if not quant_linear_cpu.can_pack(qtype, blocks.shape[0], 32 * blocks.shape[1]):
        return None
    return quant_linear_cpu.pack(qtype, blocks)
