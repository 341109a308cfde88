"""The recipes users are told to run: the README's and the guides' named run configs (blocks that open with
`# NAME.yaml`) are valid run configs, and the CPU recipe (docs/models.md) builds a model of the size the page states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CPU_RECIPE_PAGE = ROOT / "docs" / "models.md"
SMOLLM2_VOCAB = 49152


def _named_configs(page: Path) -> dict[str, str]:
    """The page's YAML blocks that open with `# NAME.yaml`, by NAME.yaml."""
    blocks = re.findall(r"```yaml\n(.*?)```", page.read_text(), re.DOTALL)
    return {m.group(1): b for b in blocks if (m := re.match(r"# ([\w.-]+\.yaml)\b", b))}


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _cpu_recipe() -> str:
    return _named_configs(CPU_RECIPE_PAGE)["cpu-sft.yaml"]


def _params(model_overrides: dict, vocab_size: int) -> int:
    import torch
    from transformers import LlamaForCausalLM

    from sftflow.tasks.train.model import model_config

    config = model_config("tiny-llama", vocab_size=vocab_size, overrides=model_overrides)
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_the_readme_and_the_data_guide_show_a_run_config():
    assert "my-sft.yaml" in _named_configs(README)
    assert "my-sft.yaml" in _named_configs(ROOT / "docs" / "data.md")


@pytest.mark.parametrize(
    "page, name",
    [(p, n) for p in _pages() for n in _named_configs(p)],
    ids=lambda v: v.name if isinstance(v, Path) else v,
)
def test_every_named_config_on_a_page_is_a_valid_run_config(tmp_path, page, name):
    from sftflow.flows.config import SFTConfig

    path = tmp_path / name
    path.write_text(_named_configs(page)[name])
    config = SFTConfig.from_yaml(path)
    assert config.data is not None and config.data.sources


def test_the_cpu_recipe_is_a_valid_config_of_the_stated_size(tmp_path):
    from sftflow.flows.config import SFTConfig

    path = tmp_path / "cpu-sft.yaml"
    path.write_text(_cpu_recipe())
    config = SFTConfig.from_yaml(path)
    assert config.train.model == "tiny-llama" and config.train.num_threads == 2
    assert config.plan.tokens_per_rank == 1024
    params = _params(config.train.model_overrides, SMOLLM2_VOCAB)
    assert f"{params / 1e6:.2f}M parameters" in CPU_RECIPE_PAGE.read_text()


def test_the_recipes_vocabulary_is_smollm2s(shared_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "smollm2-135m-chatml")
    assert len(tokenizer) == SMOLLM2_VOCAB
    assert f"# {SMOLLM2_VOCAB} tokens" in _cpu_recipe()
