"""The README's CPU recipe: its config block is a valid run config, and the model it builds has the parameters the
README states."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SMOLLM2_VOCAB = 49152


def _cpu_recipe() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.DOTALL)
    [block] = [b for b in blocks if b.startswith("# cpu-sft.yaml")]
    return block


def _params(model_overrides: dict, vocab_size: int) -> int:
    import torch
    from transformers import LlamaForCausalLM

    from sftflow.tasks.train.model import model_config

    config = model_config("tiny-llama", vocab_size=vocab_size, overrides=model_overrides)
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_the_cpu_recipe_is_a_valid_config_of_the_stated_size(tmp_path):
    from sftflow.flows.config import SFTConfig

    path = tmp_path / "cpu-sft.yaml"
    path.write_text(_cpu_recipe())
    config = SFTConfig.from_yaml(path)
    assert config.train.model == "tiny-llama" and config.train.num_threads == 2
    assert config.plan.tokens_per_rank == 1024
    params = _params(config.train.model_overrides, SMOLLM2_VOCAB)
    assert f"{params / 1e6:.2f}M parameters" in README.read_text()


def test_the_recipes_vocabulary_is_smollm2s(shared_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "smollm2-135m-chatml")
    assert len(tokenizer) == SMOLLM2_VOCAB
    assert f"# {SMOLLM2_VOCAB} tokens" in _cpu_recipe()
