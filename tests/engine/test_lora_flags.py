"""The LoRA flags as vLLM spells them: --lora-modules in both forms, its environment variable,
what the operator renders back, and the combinations EngineConfig refuses."""

from __future__ import annotations

import argparse

import pytest

from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.flags import ENGINE_FLAGS, LoRAModuleSpec, add_flags, to_args

pytestmark = pytest.mark.unit


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS, environ or {})
    return parser.parse_args(argv)


def test_lora_modules_take_name_path_and_vllm_json():
    args = _parse(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--lora-modules", "sql=/a/sql",
                   '{"name": "chat", "path": "/a/chat", "base_model_name": "smollm2"}'])
    assert args.lora_modules == [LoRAModuleSpec("sql", "/a/sql"), LoRAModuleSpec("chat", "/a/chat", "smollm2")]
    config = EngineConfig.from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 64, None)
    assert _parse(to_args({"enable_lora": True, "lora_modules": args.lora_modules})).lora_modules == args.lora_modules


def test_lora_modules_from_the_environment():
    spaced = _parse([], {"KUBEINFER_LORA_MODULES": "a=/x b=/y"}).lora_modules
    listed = _parse([], {"KUBEINFER_LORA_MODULES": '["a=/x", {"name": "b", "path": "/y"}]'}).lora_modules
    assert spaced == listed == [LoRAModuleSpec("a", "/x"), LoRAModuleSpec("b", "/y")]


@pytest.mark.parametrize("entry", ["justaname", "=/path", '{"name": "a"}', '{"name": "a", "path": "/p", "r": 8}',
                                   "{not json"])
def test_bad_lora_module_entries_are_refused(entry, capsys):
    with pytest.raises(SystemExit):
        _parse(["--enable-lora", "--lora-modules", entry])
    assert "--lora-modules" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_modules=[LoRAModuleSpec("a", "/x")]), "--lora-modules needs --enable-lora"),
    (dict(enable_lora=True, max_loras=0), "max_loras and max_lora_rank must be >= 1"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras (2) must be >= max_loras (4)"),
    (dict(enable_lora=True, lora_modules=[LoRAModuleSpec("a", "/x"), LoRAModuleSpec("a", "/y")]), "names an adapter twice"),
])
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError) as error:
        EngineConfig(**kwargs)
    assert message in str(error.value)
