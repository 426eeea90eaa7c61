"""Random LoRA adapters written by PEFT itself, for parity tests against PEFT's forward.

PEFT initialises lora_B to zero (an adapter that changes nothing); here every lora_A and
lora_B is drawn from a seeded generator instead, so each adapter moves the logits.

    path, peft_model = make_peft_adapter(base_path, tmp_path / "a", rank=8, targets=["q_proj", "v_proj"])
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base: Path | torch.nn.Module, out: Path, *, rank: int, targets: list[str], alpha: float | None = None,
                      seed: int = 0, std: float = 0.1, use_rslora: bool = False) -> tuple[Path, torch.nn.Module]:
    """Write a PEFT adapter of the model at `base` (a path, or a transformers model, which PEFT
    then wraps in place) to `out`; returns (out, the PEFT model in eval mode, fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = base if isinstance(base, torch.nn.Module) else AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out))
    return out, peft_model.eval()


def per_token_delta(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    slots_per_token: list[int]) -> torch.Tensor:
    """out + each token's own adapter delta, x[t] @ A[slot].T @ B[slot].T in float32 (slot -1:
    none): what the LoRA kernels (Triton SGMV, the CPU kernel) must compute."""
    expected = out.float().clone()
    for t, slot in enumerate(slots_per_token):
        if slot >= 0:
            expected[t] += (x[t].float() @ a[slot].float().T) @ b[slot].float().T
    return expected
