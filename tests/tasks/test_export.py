"""The export writes a tensor group at a time what `save_pretrained` writes from the whole model: the same tensor
names and values (Qwen3-MoE's experts one tensor per expert again, a tied head once), the same config, sharded the
same way past the shard size, and the first shard is on disk before the last group is gathered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from family_configs import family_config  # noqa: E402

from sftflow.tasks.train.export import export_hf, export_streamed, saved_tensor_names, tensor_groups  # noqa: E402

VOCAB = 101
FAMILIES = ["llama3_untied", "llama3_tied", "qwen3_moe", "gemma3", "phi3", "smollm3"]


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family, VOCAB), dtype=torch.float32)


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    return config


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_export_writes_what_save_pretrained_writes(family, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(family)
    target = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(target).save_pretrained(tmp_path / "reference", max_shard_size="40kB")
    # a fresh config: save_pretrained stamps the model's own with the dtype it saved
    out = export_streamed(state.__getitem__, family_config(family, VOCAB), tmp_path / "ours", tokenizer=None,
                          dtype=dtype, max_shard_bytes=40_000)  # fmt: skip

    ours, reference = _stored(out), _stored(tmp_path / "reference")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) and ours[k].dtype == target for k in reference)
    assert _config(out) == _config(tmp_path / "reference")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == want["metadata"]
    assert index["weight_map"].keys() == want["weight_map"].keys()
    files = set(index["weight_map"].values())
    assert len(files) > 1 and len(set(want["weight_map"].values())) > 1
    for file in files:  # at most the shard size, or one tensor alone (transformers' sharding, greedy in its order)
        held = [k for k, f in index["weight_map"].items() if f == file]
        assert len(held) == 1 or sum(ours[k].numel() * ours[k].element_size() for k in held) <= 40_000
    assert (out / "generation_config.json").is_file()
    assert not (tmp_path / ".ours.writing").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.to(torch.float32).load_state_dict(state)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        got, expected = reloaded(ids).logits, model(ids).logits
    if dtype == "fp32":
        assert torch.equal(got, expected)
    else:
        assert not torch.equal(got, expected) and torch.allclose(got, expected, atol=0.1)


def test_groups_are_decoder_layers_and_tied_tensors_are_stored_once():
    model = _model("llama3_tied")
    names = saved_tensor_names(model)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    groups = tensor_groups(names)
    assert groups[0] == ["model.embed_tokens.weight"] and groups[-1] == ["model.norm.weight"]
    assert [len(g) for g in groups[1:-1]] == [9] * model.config.num_hidden_layers
    assert all(name.startswith(f"model.layers.{i}.") for i, g in enumerate(groups[1:-1]) for name in g)


def test_the_first_shard_is_written_before_the_last_group_is_gathered(tmp_path):
    model = _model("llama3_untied")
    state = dict(model.state_dict())
    on_disk_when_asked = {}

    def tensor_of(name):
        on_disk_when_asked[name] = sorted(p.name for p in (tmp_path / ".hf.writing").glob("*.safetensors"))
        return state[name]

    export_streamed(tensor_of, model.config, tmp_path / "hf", tokenizer=None, max_shard_bytes=30_000)
    shards = len(list((tmp_path / "hf").glob("model-*.safetensors")))
    assert shards > 3 and on_disk_when_asked["model.embed_tokens.weight"] == []
    # the head's shard and the one before it may still be open when the head is gathered, no other
    assert len(on_disk_when_asked["lm_head.weight"]) >= shards - 2


def test_a_second_export_replaces_the_weights_and_keeps_the_rest(tmp_path):
    """A run exported again (a retry) leaves no shard of the first export behind; a LoRA run's `adapter/` stays."""
    model = _model("llama3_untied")
    state = dict(model.state_dict())
    out = export_hf(state, model.config, tmp_path / "hf", tokenizer=None, max_shard_bytes=30_000)
    (out / "adapter").mkdir()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    export_hf(state, model.config, out, tokenizer=None)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert (out / "adapter").is_dir()
    assert _stored(out).keys() == set(saved_tensor_names(model))


def test_a_state_dict_that_does_not_match_the_model_is_refused(tmp_path):
    model = _model("llama3_untied")
    state = dict(model.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing weights \['model\.layers\.1\.mlp\.up_proj\.weight'\], unexpected "
                                         r"\['model\.layers\.9\.mlp\.up_proj\.weight'\]"):  # fmt: skip
        export_hf(state, model.config, tmp_path / "hf", tokenizer=None)
    assert not (tmp_path / "hf").exists()
