"""Tokens a template writes but the tokenizer lacks (ChatML or Gemma cues on another base) are added to a copy of the
tokenizer, and the model's embeddings and head grow to match, new rows starting at the mean of the old ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sftflow.tasks.core.fingerprint import sha256_tree
from sftflow.tasks.data.render import RenderConfig
from sftflow.tasks.data.stage import TokenizerRef, with_template_tokens
from tests.tasks.family_configs import save_family_model


def _ref(path: Path) -> TokenizerRef:
    return TokenizerRef(path=str(path), sha256=sha256_tree(path))


def test_missing_template_tokens_are_added_to_a_copy_once(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    original = _ref(tiny_tokenizer_dir)
    assert with_template_tokens(RenderConfig(template="chatml"), original, tmp_path) == original  # has ChatML's
    grown = with_template_tokens(RenderConfig(template="gemma"), original, tmp_path)
    assert grown.path != original.path and Path(grown.path).parent == tmp_path / "tokenizers"
    before, after = AutoTokenizer.from_pretrained(original.path), AutoTokenizer.from_pretrained(grown.path)
    assert len(after) == len(before) + 2
    ids = after("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)["input_ids"]
    assert ids[0] == after.convert_tokens_to_ids("<start_of_turn>") >= len(before)
    assert with_template_tokens(RenderConfig(template="gemma"), original, tmp_path) == grown  # reused, same hash


@pytest.mark.parametrize("name", ["llama3_untied", "qwen3"])
def test_grown_embeddings_start_at_the_mean_of_the_old_rows(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.model import build_training_model
    from sftflow.tasks.train.weights import materialize

    folder = save_family_model(name, 101, tmp_path / name)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lm, files = build_training_model(str(folder), vocab_size=104, packed=True)
    materialize(lm, lm, torch.device("cpu"), files)
    for got, want in (
        (lm.get_input_embeddings().weight, original.get_input_embeddings().weight),
        (lm.get_output_embeddings().weight, original.get_output_embeddings().weight),
    ):
        assert got.shape == (104, want.shape[1])
        assert torch.equal(got[:101], want)
        assert torch.allclose(got[101:], want.mean(0, keepdim=True).expand(3, -1))
    assert lm.config.vocab_size == 104
    if original.config.tie_word_embeddings:
        assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight


@pytest.mark.slow
def test_training_with_added_tokens_grows_the_model_and_exports_it(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sftflow.tasks.plan.planner import PlanConfig
    from tests.tasks.train_helpers import losses, planned_mock, run

    grown = with_template_tokens(RenderConfig(template="gemma"), _ref(tiny_tokenizer_dir), tmp_path)
    vocab = len(AutoTokenizer.from_pretrained(grown.path))
    folder = save_family_model("llama3_untied", vocab - 2, tmp_path / "base")  # the base knows neither new token
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=96, micro_batches_per_step=1, epochs=1, seed=0)
    mock = dict(num_docs=12, median_length=30, max_length=60, min_token_id=3)
    base, _, _ = planned_mock(tmp_path, vocab, Path(grown.path), plan_config, mock=mock, model=str(folder))
    run(base, tmp_path / "run", max_steps=2, export=True)
    assert all(loss == loss for loss in losses(tmp_path / "run"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    assert exported.config.vocab_size == vocab and exported.get_output_embeddings().weight.shape[0] == vocab
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "hf").convert_tokens_to_ids("<end_of_turn>") == vocab - 1


def test_lora_on_a_grown_vocabulary_is_refused_before_launch(tmp_path, tiny_tokenizer_dir):
    """Frozen embeddings could never learn the added tokens: refused with the way out, before torchrun starts."""
    from sftflow.tasks.plan.planner import PlanConfig
    from tests.tasks.train_helpers import planned_mock, run

    folder = save_family_model("qwen3", 97, tmp_path / "base")
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=96, micro_batches_per_step=1, epochs=1, seed=0)
    mock = dict(num_docs=12, median_length=30, max_length=60, min_token_id=3)
    base, _, _ = planned_mock(tmp_path, 99, None, plan_config, mock=mock, model=str(folder), tokenizer=None)
    with pytest.raises(ValueError, match=r"2 tokens the model lacks .* LoRA keeps the embeddings frozen"):
        run(base, tmp_path / "run", max_steps=1, lora={"rank": 4})
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_your_own_template_declares_the_tokens_it_writes(tiny_tokenizer_dir, tmp_path):
    """A .jinja of the user's that writes special-looking tokens the tokenizer lacks is refused until it says what
    they are: tokens to add (`template_tokens`), or text (`template_tokens: []`)."""
    from transformers import AutoTokenizer

    from sftflow.tasks.data.chat_template import builtin_template_text
    from sftflow.tasks.data.render import TemplateProblem, resolve_template

    mine = tmp_path / "mine.jinja"
    mine.write_text(builtin_template_text("llama3"))  # <|start_header_id|>, <|end_header_id|>, <|eot_id|>
    original = _ref(tiny_tokenizer_dir)
    message = r"writes \['<\|end_header_id\|>', '<\|eot_id\|>', '<\|start_header_id\|>'\].*data.render.template_tokens"
    with pytest.raises(TemplateProblem, match=message):
        resolve_template(RenderConfig(template=str(mine)), original.path)
    as_text = RenderConfig(template=str(mine), template_tokens=[])
    assert resolve_template(as_text, original.path).writes_tokens == ()
    assert with_template_tokens(as_text, original, tmp_path) == original
    declared = RenderConfig(
        template=str(mine), template_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    grown = with_template_tokens(declared, original, tmp_path)
    tok = AutoTokenizer.from_pretrained(grown.path)
    assert len(tok) == len(AutoTokenizer.from_pretrained(original.path)) + 3
    ids = tok("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|start_header_id|>") and ids[-1] == tok.convert_tokens_to_ids(
        "<|eot_id|>"
    )
    resolve_template(RenderConfig(template=str(mine)), grown.path)  # the grown tokenizer has them: no complaint
    chatml = tmp_path / "chatml.jinja"
    chatml.write_text(builtin_template_text("chatml"))
    resolve_template(RenderConfig(template=str(chatml)), original.path)  # tokens the tokenizer has pass as they are
