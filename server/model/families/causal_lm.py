"""What every model family shares: the forward contract with the engine and the weight plumbing.

A family subclasses `CausalLM`, builds its modules from `ModelConfig` with the layers of this
package (whose `ParallelRole`s give it tensor parallelism) and names, in `packed_modules`, the
checkpoint matrices its merged linears stack. Loading (`load_weights`), oneDNN prepacking and
the quantized forms (`quantization/`) then work for it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Iterator

import torch
from torch import nn

from ..checkpoints.checkpoint import FusedParts
from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from ..layers.linear import Linear, MergedLinear, ParallelRole, can_pack, linear, pack_weight
from ..layers.moe import FusedExperts
from ..layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from ..quantization.weights import QuantizedLinearWeight


class CausalLM(nn.Module):
    """A decoder over the paged KV cache. `forward(batch, kv_caches)` returns float32 logits
    [len(batch.logits_indices), vocab] and writes the step's K/V into `kv_caches`."""

    # checkpoint projection name -> (merged module name, shard index), e.g. "k_proj": ("qkv_proj", 1)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head: Linear | None = None   # None = tied to `input_embeddings()`
        self.packed_tied_head: torch.Tensor | None = None
        self.quantized_tied_head: QuantizedLinearWeight | None = None   # GGUF's blocks (`quantization/gguf.py`)

    @classmethod
    def fused_checkpoint_parts(cls, config: ModelConfig) -> FusedParts:
        """Checkpoint matrices that stack several projections (split at load, before tensor
        parallelism slices them); none by default."""
        return {}

    def input_embeddings(self) -> nn.Embedding:
        """Every family keeps its decoder in `self.model` with `embed_tokens`, as transformers does."""
        return self.model.embed_tokens

    def build_lm_head(self) -> None:
        """An output projection of its own unless the checkpoint ties it to the embeddings; called
        after `self.model` exists so the modules keep transformers' order."""
        if not self.config.tie_word_embeddings:
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False,
                                  role=ParallelRole.VOCAB)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab_size]; writes this step's K/V into `kv_caches`."""
        return self.logits(self.hidden_states(batch, kv_caches))

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The final (normed) hidden states of the rows `batch.logits_indices` names, [rows, hidden]:
        what the LM head reads, and what an embedding model pools. Writes the step's K/V."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (through the tied embedding when there is no lm_head)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.quantized_tied_head is not None:
            return self.quantized_tied_head.forward(hidden, None).float()
        return linear(hidden, self.input_embeddings().weight, self.packed_tied_head).float()

    def reset_rotary(self, device: torch.device) -> None:
        """float32 rotary frequencies again after the model's `.to(dtype)`."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_inv_freq(device)

    @torch.no_grad()
    def pack_weights(self) -> None:
        """Prepack every GEMM weight for oneDNN where that is faster (CPU bf16, see linear.py).
        Call once after `load_weights`: packed layers cannot be reloaded."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedExperts)):
                module.pack()
        embedding = getattr(self.input_embeddings(), "weight", None)   # None: a pipeline stage without them
        if self.lm_head is None and self.packed_tied_head is None and embedding is not None and can_pack(embedding):
            self.packed_tied_head = pack_weight(embedding)   # a copy: the embedding lookup needs the plain table

    def checkpoint_sources(self, name: str, module: nn.Module) -> list[tuple[str, int | None]]:
        """The checkpoint modules behind module `name`: itself, or a merged module's
        projections as (checkpoint module name, shard index) in shard order."""
        if not isinstance(module, MergedLinear):
            return [(name, None)]
        parent, _, merged = name.rpartition(".")
        shards = sorted((shard, proj) for proj, (target, shard) in self.packed_modules.items() if target == merged)
        return [(f"{parent}.{proj}", shard) for shard, proj in shards]

    def checkpoint_modules(self) -> Iterator[tuple[str, nn.Module, int | None]]:
        """(checkpoint module name, module holding it, shard index) for every module with parameters."""
        for name, module in self.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            for source, shard in self.checkpoint_sources(name, module):
                yield source, module, shard

    def stacked_tensors(self) -> dict[str, tuple[FusedExperts, str]]:
        """Checkpoint tensor name -> (module whose parameters stack it, its name there): the
        per-expert matrices of MoE layers (quantized ones are the quantization loader's)."""
        return {f"{name}.{part}": (module, part) for name, module in self.named_modules()
                if isinstance(module, FusedExperts) and module.quant is None
                for part, _, _ in module.checkpoint_layout()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) in, converting dtype; every parameter must be set."""
        params = dict(self.named_parameters())
        stacked = self.stacked_tensors()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in stacked:
                module, part = stacked[name]
                module.load_checkpoint_tensor(part, tensor)
                loaded.add(name)
                continue
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name == "rope_freqs.weight":   # GGUF Llama 3.1+: per-frequency divisors
                for module in self.modules():
                    if isinstance(module, RotaryEmbedding):
                        module.inv_freq.div_(tensor.to(module.inv_freq))
                continue
            module_name, _, kind = name.rpartition(".")
            parent, _, proj = module_name.rpartition(".")
            if proj in self.packed_modules:
                merged, shard = self.packed_modules[proj]
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
        missing = (self._expected_weights() | set(stacked)) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:8])}")

    def _expected_weights(self) -> set[str]:
        """Parameter names, merged ones as `name#shard` (one entry per checkpoint matrix); stacked
        expert parameters are accounted for by `stacked_tensors`."""
        expected = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, FusedExperts):
                continue
            shards = len(module.output_sizes) if isinstance(module, MergedLinear) else 0
            expected.update([f"{name}#{i}" for i in range(shards)] if shards else [name])
        return expected

    def _param(self, params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for a {self.config.architecture} model")
        return params[name]

