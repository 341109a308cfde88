"""The tokenizer metadata read from files must equal what transformers reports for the same folder, or the reader
must step aside (None) so that transformers reads it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sftflow.tasks.data.tokenizer_files import read_tokenizer_files
from tests.conftest import SHARED_DATA


def _assert_same(folder: Path) -> None:
    files = read_tokenizer_files(folder)
    assert files is not None, folder
    tok = AutoTokenizer.from_pretrained(str(folder))
    expected = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    assert files.special_tokens_map == expected
    assert files.chat_template == (tok.chat_template or None)
    assert set(files.get_vocab()) == set(tok.get_vocab())


def test_tiny_tokenizer_matches_transformers(tiny_tokenizer_dir):
    _assert_same(tiny_tokenizer_dir)


def test_template_in_config_and_special_tokens_as_dicts(tiny_tokenizer_dir, tmp_path):
    """Older folders keep the template inside tokenizer_config.json and special tokens as AddedToken dicts, and
    may name an EOS the vocabulary lacks (transformers adds it)."""
    folder = tmp_path / "old"
    shutil.copytree(tiny_tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config["eos_token"] = {"__type": "AddedToken", "content": "<|eot|>", "lstrip": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    mapped = {"unk_token": "<pad>", "bos_token": {"content": "<pad>", "special": True}}  # wins over the config
    (folder / "special_tokens_map.json").write_text(json.dumps(mapped))
    _assert_same(folder)
    assert "<|eot|>" in read_tokenizer_files(folder).get_vocab()


def test_named_template_list_is_left_to_transformers(tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / "named"
    shutil.copytree(tiny_tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages }}"}]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_tokenizer_files(folder) is None


def test_no_tokenizer_json_is_left_to_transformers(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert read_tokenizer_files(tmp_path) is None


@pytest.mark.parametrize("name", ["smollm2-135m-chatml", "tinyllama-1.1b-chat-v1.0"])
def test_real_tokenizers_match_transformers(name):
    folder = SHARED_DATA / "tokenizers" / name
    if not folder.is_dir():
        pytest.skip(f"{folder} not present")
    _assert_same(folder)


def test_resolving_a_template_does_not_import_torch(tiny_tokenizer_dir, tmp_path):
    """What keeps a Cached `sftflow data` fast: resolving the template and its tokens reads files only."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from sftflow.tasks.data.render import RenderConfig\n"
        "from sftflow.tasks.data.stage import TokenizerRef, template_sha256, with_template_tokens\n"
        f"ref = TokenizerRef(path={str(tiny_tokenizer_dir)!r}, sha256='0' * 64)\n"
        "config = RenderConfig(template='chatml')\n"
        f"assert with_template_tokens(config, ref, Path({str(tmp_path)!r})) == ref\n"
        "template_sha256(config, ref)\n"
        "print('torch' in sys.modules, 'transformers.tokenization_utils_base' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
