"""Tiny, offline model assets: a byte-level BPE tokenizer trained on given text and a random-init Llama config.

These make the demo, the tests and CPU smoke runs independent of any model hub.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<pad>"]


def builtin_chatml_template() -> str:
    return resources.files("sftflow.tasks.data").joinpath("templates/chatml.jinja").read_text()


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512, chat_template: str | None = None):
    """Train a byte-level BPE on `texts` and save it as a Hugging Face fast tokenizer folder.

    BOS is `<s>` and is not added automatically (like most chat tokenizers); EOS is `<|im_end|>`, the end of an
    assistant turn in ChatML, so a model trained on it learns to stop.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token=None,
    )
    fast.chat_template = chat_template if chat_template is not None else builtin_chatml_template()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    """A random-init Llama small enough to train on two CPU cores in seconds per step (the `tiny` shape of
    `sftflow.tasks.shapes`)."""
    from transformers import LlamaConfig

    from sftflow.tasks.shapes import SHAPES

    return LlamaConfig(**SHAPES["tiny"].fields(vocab_size=vocab_size, **overrides))
