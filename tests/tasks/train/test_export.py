"""The export writes a tensor group at a time what `save_pretrained` writes from the whole model: the same tensor
names and values (Qwen3-MoE's experts one tensor per expert again, a tied head once), the same config, sharded the
same way past the shard size, and the first shard is on disk before the last group is gathered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sftflow.tasks.train.export import export_hf, export_streamed, saved_tensor_names, tensor_groups
from tests.tasks.family_configs import family_config

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


def test_an_export_carries_checksums_that_its_readers_check(tmp_path):
    """The folder lists every file's sha256; evaluation and training refuse a damaged file or one left from another
    export (a folder caught mid-swap), naming it; files have the user's umask, not 0600."""
    import os

    from sftflow.tasks.core.manifests import ModelRef
    from sftflow.tasks.eval.stage import load_model
    from sftflow.tasks.train.export import verify_export

    model = _model("llama3_untied")
    state = dict(model.state_dict())
    out = export_hf(state, model.config, tmp_path / "hf", tokenizer=None)
    listed = {line.split("  ", 1)[1] for line in (out / "CHECKSUMS").read_text().splitlines()}
    assert listed == {p.name for p in out.iterdir() if p.name != "CHECKSUMS"} and "model.safetensors" in listed
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    verify_export(out)
    load_model(ModelRef(spec=str(out)), vocab_size=None)  # an intact export loads
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors does not match its sha256 in .*CHECKSUMS"):
        load_model(ModelRef(spec=str(out)), vocab_size=None)
    weights.unlink()
    with pytest.raises(ValueError, match=r"model.safetensors is missing from the exported model"):
        verify_export(out)


def test_a_state_dict_that_does_not_match_the_model_is_refused(tmp_path):
    model = _model("llama3_untied")
    state = dict(model.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing weights \['model\.layers\.1\.mlp\.up_proj\.weight'\], unexpected "
                                         r"\['model\.layers\.9\.mlp\.up_proj\.weight'\]"):  # fmt: skip
        export_hf(state, model.config, tmp_path / "hf", tokenizer=None)
    assert not (tmp_path / "hf").exists()


def _lora_model(family: str, seed: int = 1):
    """A tiny model with PEFT's adapters injected as training injects them, lora_B made non-zero (trained)."""
    from sftflow.tasks.train.config import LoraSettings
    from sftflow.tasks.train.lora import apply_lora

    model = _model(family)
    settings = LoraSettings(rank=4, alpha=8.0)
    apply_lora(model, settings, family)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return model, settings


@pytest.mark.parametrize("family", ["llama3_tied", "phi3"])
def test_the_streamed_merge_is_peft_merge_and_unload(family, tmp_path):
    """Each wrapped linear's base plus its adapters' product, as PEFT merges them, tied head and fused projections
    included, to the bit in fp32."""
    import copy

    from sftflow.tasks.train.lora import merged_tensor_of

    lm, _ = _lora_model(family)
    adapters = {n: p.detach().clone() for n, p in lm.named_parameters() if p.requires_grad}
    base_of = lambda name: lm.get_parameter(name) if "." in name else None  # noqa: E731
    out = export_streamed(merged_tensor_of(lm, base_of, adapters), lm.config, tmp_path / "hf", dtype="fp32")

    from peft.tuners.tuners_utils import BaseTunerLayer

    reference = copy.deepcopy(lm)
    for module in reference.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    want = {}
    for name, tensor in reference.state_dict().items():
        if ".lora_" not in name:
            want[name.replace(".base_layer.", ".")] = tensor
    got = _stored(out)
    assert got.keys() <= want.keys() and len(got) == len(saved_tensor_names(_model(family)))
    assert all(torch.equal(got[k], want[k]) for k in got)
    changed = [k for k in got if not torch.equal(got[k], _model(family).state_dict()[k])]
    assert changed and all("proj" in k for k in changed)


def test_the_adapter_folder_is_what_peft_saves(tmp_path):
    """Written from the adapters alone (a PEFT model on the meta device): the files PEFT writes from the whole model."""
    from peft import get_peft_model
    from safetensors.torch import load_file

    from sftflow.tasks.train.lora import export_adapter, peft_config

    lm, settings = _lora_model("llama3_untied")
    adapters = {n: p.detach().clone() for n, p in lm.named_parameters() if p.requires_grad}
    export_adapter(adapters, lm.config, settings, "base-model", tmp_path / "ours")

    whole = get_peft_model(_model("llama3_untied"), peft_config(settings, "base-model"))
    whole.base_model.model.load_state_dict(lm.state_dict())
    whole.save_pretrained(tmp_path / "peft", safe_serialization=True)
    ours, want = (
        load_file(tmp_path / "ours" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config.pop("base_model_name_or_path") == "base-model"  # where PeftModel.from_pretrained finds the base
    want_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    want_config.pop("base_model_name_or_path")
    assert config == want_config
    adapters.pop(next(iter(adapters)))
    with pytest.raises(ValueError, match="missing adapters"):
        export_adapter(adapters, lm.config, settings, "base-model", tmp_path / "bad")


def test_the_qlora_base_is_read_a_tensor_at_a_time_from_its_folder(tmp_path):
    """What the merge adds the adapters to: the checkpoint's tensors in bf16 (from_pretrained's values), read one at a
    time from a folder that holds them under their names; converted ones (stacked experts) come from
    `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.quantize import base_tensor_of

    lm, _ = _lora_model("llama3_tied")
    _model("llama3_tied").save_pretrained(tmp_path / "base", max_shard_size="30kB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16).state_dict()
    opened = []
    import safetensors

    real_open = safetensors.safe_open

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    safetensors.safe_open = counting_open
    try:
        base_of = base_tensor_of(lm, str(tmp_path / "base"))
        q = base_of("model.layers.1.self_attn.q_proj.base_layer.weight")
        norm = base_of("model.norm.weight")
    finally:
        safetensors.safe_open = real_open
    assert q.dtype == torch.bfloat16 and torch.equal(q, reference["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(norm, reference["model.norm.weight"])
    assert len(opened) == 2  # one file per tensor read, nothing else

    moe, _ = _lora_model("qwen3_moe")
    _model("qwen3_moe").save_pretrained(tmp_path / "moe")  # one tensor per expert: not the model's stacked ones
    stacked = base_tensor_of(moe, str(tmp_path / "moe"))("model.layers.0.mlp.experts.gate_up_proj")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.bfloat16).state_dict()
    assert torch.equal(stacked, want["model.layers.0.mlp.experts.gate_up_proj"])
