"""Quantized variants of the tiny HF models, written by the tests, and their dequantized references.

- `quantize_compressed_tensors`: a scheme of the `compressed-tensors` package (W4A16, W8A8,
  FP8, ...) applied to the model, scales from each weight's min/max through the package's
  `calculate_qparams`, compressed and saved by its `ModelCompressor` (what llm-compressor does
  after calibration). The reference model holds the package's own `fake_quantize` of each weight.
- `write_gptq` / `write_awq`: integer weights of a known grid (each group's min/max, asymmetric
  or symmetric, optionally act-order), packed here as the gptq / autoawq packers lay them out.
  The reference holds (q - zero) * scale with the fp16 scales the checkpoint stores.

Every builder returns (checkpoint path, reference transformers model in float32). Activation
quantization is not in the reference's weights: `add_activation_fake_quant` hooks it onto the
reference's linear layers (per-token int8 amax/127 or e4m3 amax/448, vLLM's convention).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _quantized_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")]


def _copy_side_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, target / name)


def _min_max(weight: torch.Tensor, strategy: str, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "group":
        groups = weight.reshape(weight.shape[0], -1, group_size)
        return groups.amin(-1), groups.amax(-1)
    if strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    return weight.amin().reshape(1), weight.amax().reshape(1)


def quantize_compressed_tensors(path: Path, hf_model: torch.nn.Module, scheme: dict, target: Path,
                                static_input_scale: float | None = None) -> tuple[Path, torch.nn.Module]:
    """`scheme` as config.json spells a config group ({"weights": {...}, "input_activations": ...});
    `static_input_scale` fills `input_scale` of static activation schemes."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(hf_model)
    reference = copy.deepcopy(hf_model)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for (name, module), (_, ref_module) in zip(_quantized_linears(model), _quantized_linears(reference), strict=True):
        args = module.quantization_scheme.weights
        weight = module.weight.detach()
        scale, zero = calculate_qparams(*_min_max(weight, args.strategy, args.group_size), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
        if hasattr(module, "input_scale") and static_input_scale is not None:
            module.input_scale.data.fill_(static_input_scale)
        zero_point = getattr(module, "weight_zero_point", None)
        ref_module.weight.data = fake_quantize(weight, module.weight_scale, zero_point, args)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    _copy_side_files(path, target)
    return target, reference


def _grid(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer weights q [N, K] in [0, 2^bits), fp16-exact scales and integer zeros [N, K/group]."""
    top = (1 << bits) - 1
    groups = weight.reshape(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(-low, high) / ((top + 1) // 2 - 0.5)
        zero = torch.full_like(scale, float((top + 1) // 2))
    else:
        scale = (high - low) / top
        zero = torch.round(-low / scale).clamp(0, top)
    scale = scale.half().float()
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, top)
    return q.reshape(weight.shape).to(torch.int64), scale, zero.to(torch.int64)


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values packed 32/bits per int32 along `dim`, value i of each word at bits*i
    (with `order`, word slot i holds the word's value number order[i], as autoawq's packer)."""
    per_word = 32 // bits
    values = values.movedim(dim, -1)
    words = values.reshape(*values.shape[:-1], -1, per_word)
    packed = torch.zeros(words.shape[:-1], dtype=torch.int64)
    for slot in range(per_word):
        packed |= words[..., order[slot] if order else slot] << (bits * slot)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _write(path: Path, hf_model: torch.nn.Module, target: Path, quantized: dict[str, torch.Tensor],
           quantization_config: dict) -> None:
    skip = {f"{name}.weight" for name, _ in _quantized_linears(hf_model)}
    tensors = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items() if name not in skip}
    tensors.update(quantized)
    _copy_side_files(path, target)
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2))


def write_gptq(path: Path, hf_model: torch.nn.Module, target: Path, *, bits: int = 4, group_size: int = 32,
               symmetric: bool = False, desc_act: bool = False, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """GPTQ v1 (`checkpoint_format: gptq`, zeros stored minus one); with desc_act each layer's
    input features are assigned to groups in a random order (g_idx), one order for the layers that
    read the same input (q/k/v, gate/up: GPTQ sorts by the input's Hessian diagonal)."""
    reference = copy.deepcopy(hf_model)
    generator = torch.Generator().manual_seed(seed)
    quantized = {}
    orders: dict[str, torch.Tensor] = {}
    shared_input = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    for (name, module), (_, ref_module) in zip(_quantized_linears(hf_model), _quantized_linears(reference),
                                               strict=True):
        weight = module.weight.detach().float()
        in_features = weight.shape[1]
        parent, _, proj = name.rpartition(".")
        key = f"{parent}.{shared_input.get(proj, proj)}"
        if key not in orders:
            orders[key] = torch.randperm(in_features, generator=generator) if desc_act else torch.arange(in_features)
        order = orders[key]
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
        q_sorted, scale, zero = _grid(weight[:, order], bits, group_size, symmetric)   # groups over `order`
        q = torch.empty_like(q_sorted)
        q[:, order] = q_sorted
        groups = g_idx.long()
        ref_module.weight.data = (q - zero[:, groups]).float() * scale[:, groups]
        quantized[f"{name}.qweight"] = _pack(q.t(), bits, 0)
        quantized[f"{name}.qzeros"] = _pack((zero - 1).t() & ((1 << bits) - 1), bits, 1)
        quantized[f"{name}.scales"] = scale.t().half().contiguous()
        quantized[f"{name}.g_idx"] = g_idx
    _write(path, hf_model, target, quantized, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": symmetric,
        "checkpoint_format": "gptq", "true_sequential": True, "lm_head": False})
    return target, reference


def write_awq(path: Path, hf_model: torch.nn.Module, target: Path, *, group_size: int = 32
              ) -> tuple[Path, torch.nn.Module]:
    """AWQ GEMM: 4-bit, zero points, qweight/qzeros packed along the outputs in autoawq's order."""
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
    reference = copy.deepcopy(hf_model)
    quantized = {}
    for (name, module), (_, ref_module) in zip(_quantized_linears(hf_model), _quantized_linears(reference),
                                               strict=True):
        q, scale, zero = _grid(module.weight.detach().float(), 4, group_size, symmetric=False)
        groups = torch.arange(q.shape[1]) // group_size
        ref_module.weight.data = (q - zero[:, groups]).float() * scale[:, groups]
        quantized[f"{name}.qweight"] = _pack(q.t(), 4, 1, awq_order)
        quantized[f"{name}.qzeros"] = _pack(zero.t(), 4, 1, awq_order)
        quantized[f"{name}.scales"] = scale.t().half().contiguous()
    _write(path, hf_model, target, quantized, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None})
    return target, reference


def write_fp8(path: Path, hf_model: torch.nn.Module, target: Path, *, activation_scheme: str = "dynamic",
              input_scale: float = 0.01) -> tuple[Path, torch.nn.Module]:
    """`quant_method: fp8` (AutoFP8's layout): e4m3 weights with one float32 scale per tensor."""
    reference = copy.deepcopy(hf_model)
    quantized = {}
    for (name, module), (_, ref_module) in zip(_quantized_linears(hf_model), _quantized_linears(reference),
                                               strict=True):
        weight = module.weight.detach().float()
        scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        fp8 = (weight / scale).to(torch.float8_e4m3fn)
        ref_module.weight.data = fp8.float() * scale
        quantized[f"{name}.weight"] = fp8
        quantized[f"{name}.weight_scale"] = scale.reshape(())
        if activation_scheme == "static":
            quantized[f"{name}.input_scale"] = torch.tensor(input_scale)
    _write(path, hf_model, target, quantized, {"quant_method": "fp8", "activation_scheme": activation_scheme})
    return target, reference


def add_activation_fake_quant(model: torch.nn.Module, kind: str, static_scale: float | None = None,
                              per_tensor: bool = False) -> None:
    """Round the input of every quantized linear layer of `model` as the engine's W8A8 / FP8 paths
    do: 'int8' (symmetric, per token amax/127, or `static_scale`) or 'fp8' (e4m3, amax/448 per
    token, or over the whole input with `per_tensor`)."""

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0].float()
        top = 127.0 if kind == "int8" else float(torch.finfo(torch.float8_e4m3fn).max)
        amax = x.abs().amax() if per_tensor else x.abs().amax(-1, keepdim=True)
        scale = torch.tensor(static_scale) if static_scale is not None else amax.clamp(min=1e-10) / top
        if kind == "int8":
            return (torch.round(x / scale).clamp(-128, 127) * scale,)
        return ((x / scale).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale,)

    for _, module in _quantized_linears(model):
        module.register_forward_pre_hook(hook)


def write_compressed_moe(path: Path, target: Path, scheme: dict, format: str) -> tuple[Path, Path]:
    """An MoE checkpoint in compressed-tensors `format` ("pack-quantized", "int-quantized"): every
    2-D matrix of the decoder layers, per-expert matrices included, quantized per tensor with the
    package's `calculate_qparams` / `quantize` / `pack_to_int32` (transformers 5 holds experts as
    3-D parameters, which the package's module-level `apply_quantization_config` does not reach;
    llm-compressor's MoE checkpoints name each expert's matrices as here). The routers stay
    dense (`ignore`), as llm-compressor's MoE recipes leave them. Returns (quantized dir, dense dir
    with the dequantized weights: load it with transformers for the reference)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    args = QuantizationArgs(**scheme["weights"])
    quantized, dense = {}, {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and tensor.dim() == 2 and not module.endswith(".gate")):
            quantized[name] = dense[name] = tensor
            continue
        weight = tensor.float()
        scale, zero = calculate_qparams(*_min_max(weight, args.strategy, args.group_size), args)
        q = quantize(weight, scale, zero, args)
        dense[name] = dequantize(q, scale, zero, args).float()
        if format == "pack-quantized":
            quantized[f"{module}.weight_packed"] = pack_to_int32(q.to(torch.int8), args.num_bits)
            quantized[f"{module}.weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int32)
        else:
            quantized[f"{module}.weight"] = q.to(torch.int8)
        quantized[f"{module}.weight_scale"] = scale.float().reshape(weight.shape[0], -1)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head", "re:.*\\.gate$"], format=format, quantization_status="compressed")
    hf_config = json.loads((path / "config.json").read_text())
    for directory, tensors, quantization in ((target, quantized, config.model_dump(mode="json")),
                                             (target.with_name(target.name + "-dequantized"), dense, None)):
        _copy_side_files(path, directory)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        config_json = dict(hf_config, **({"quantization_config": quantization} if quantization else {}))
        (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    return target, target.with_name(target.name + "-dequantized")


def add_expert_activation_fake_quant(model: torch.nn.Module) -> None:
    """Per-token int8 rounding (amax/127) of the inputs of every expert's gate|up and down matmuls,
    as the engine's W8A8 experts compute: transformers 5's experts modules (3-D gate_up_proj /
    down_proj) run their own loop, replaced here by the same loop with the rounding."""
    from torch.nn import functional as F

    def rounded(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0
        return torch.round(x / scale).clamp(-128, 127) * scale

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            if token.numel():
                gate, up = F.linear(rounded(hidden_states[token]), self.gate_up_proj[expert]).chunk(2, dim=-1)
                down = F.linear(rounded(self.act_fn(gate) * up), self.down_proj[expert])
                out.index_add_(0, token, down * top_k_weights[token, slot, None])
        return out

    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "gate_up_proj"):
            module.forward = forward.__get__(module)
