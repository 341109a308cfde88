"""Qwen3-MoE's experts are read shard by shard into the fused parameters transformers 5 holds them in.

Hub checkpoints (and `save_pretrained`) store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...); the
model holds one `gate_up_proj` and one `down_proj` over all experts. The reference is `from_pretrained`, which fuses
them with transformers' own conversion: sftflow's meta-built model, each rank reading only its experts, must equal
it exactly, from a per-expert checkpoint (split over several files, fp32 or bf16), from one already fused, and on 1
and 2 FSDP ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sftflow.tasks.train.model import build_training_model
from sftflow.tasks.train.weights import StackedExperts, checkpoint_sources, materialize

if __package__:  # collected by pytest
    from tests.tasks.family_configs import family_config
else:  # a torchrun worker runs this file as a script: the shared helpers sit one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from family_configs import family_config

VOCAB = 101
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def save_moe(folder: Path, layout: str, *, num_experts: int = 4, dtype: torch.dtype = torch.float32) -> Path:
    """A random tiny Qwen3-MoE (its real config's structure, `tests/tasks/family_configs.py`) saved `per_expert`
    (what `save_pretrained` writes, as the hub holds it, here split over files of 30 kB so that one expert's tensors
    span several) or `fused` (the model's own tensor names, written with safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config("qwen3_moe", VOCAB)
    config.num_experts = num_experts
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    if layout == "per_expert":
        model.save_pretrained(folder, max_shard_size="30kB")
    else:
        model.config.save_pretrained(folder)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def stored_names(folder: Path) -> dict[str, str]:
    """Tensor name -> file name of a saved folder."""
    from sftflow.tasks.train.weights import CheckpointFiles

    return {name: path.name for name, path in CheckpointFiles.find(folder).files.items()}


def assert_equal_to_from_pretrained(params: dict[str, torch.Tensor], folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    want = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    assert params.keys() == want.keys()
    for name, value in want.items():
        assert params[name].dtype == torch.float32, name
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize(
    ("layout", "dtype"), [("per_expert", torch.float32), ("per_expert", torch.bfloat16), ("fused", torch.float32)]
)
def test_experts_read_onto_a_meta_model_equal_from_pretrained(layout, dtype, tmp_path):
    folder = save_moe(tmp_path / "model", layout, dtype=dtype)
    names = stored_names(folder)
    if layout == "per_expert":
        assert GATE_UP not in names
        # One expert's gate and up, stacked into one parameter, are in two files.
        experts = "model.layers.1.mlp.experts"
        assert names[f"{experts}.2.gate_proj.weight"] != names[f"{experts}.2.up_proj.weight"]
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=True)
    assert files is not None and all(p.is_meta for p in lm.parameters())  # not the whole-model fallback
    sources, missing = checkpoint_sources(lm, files)
    assert missing == []
    if layout == "per_expert":
        gate_up = sources[GATE_UP]
        assert isinstance(gate_up, StackedExperts) and gate_up.dim == 0
        assert [part[2] for part in gate_up.parts] == [
            "model.layers.1.mlp.experts.2.gate_proj.weight",  # gate first, then up: the model chunks it so
            "model.layers.1.mlp.experts.2.up_proj.weight",
        ]
    else:
        assert sources[GATE_UP] == GATE_UP
    materialize(lm, lm, torch.device("cpu"), files)
    assert_equal_to_from_pretrained(dict(lm.named_parameters()), folder)


def test_a_checkpoint_missing_an_expert_is_refused_naming_the_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_moe(tmp_path / "model", "fused")
    whole = save_moe(tmp_path / "per_expert", "per_expert")
    state = {}
    for file in sorted(set(stored_names(whole).values())):
        state.update(load_file(whole / file))
    state = {name: t for name, t in state.items() if ".experts.3." not in name}
    (folder / "model.safetensors").unlink()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=True)
    message = r"gate_up_proj stacks .* 3 tensors like model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight where .* 4"
    with pytest.raises(ValueError, match=message):
        materialize(lm, lm, torch.device("cpu"), files)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp_ranks_read_their_own_experts_and_together_equal_from_pretrained(nproc, tmp_path):
    """Through torchrun (gloo): 5 experts over 2 ranks shard unevenly (3 and 2), so rank 1's rows start mid-layer."""
    from safetensors.torch import load_file

    folder = save_moe(tmp_path / "model", "per_expert", num_experts=5)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*command, __file__, str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    local = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    assert [r["experts"] for r in local] == ([5] if nproc == 1 else [3, 2])
    assert all(r["read_by_slices"] for r in local)
    assert_equal_to_from_pretrained(load_file(out / "params.safetensors"), folder)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_the_export_is_per_expert_and_reloads_to_the_same_logits(layout, tmp_path):
    """`export_hf` writes what `save_pretrained` writes (one tensor per expert, as the hub holds it) whichever layout
    the model was read from; `from_pretrained` and sftflow's own loader both read it back to the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftflow.tasks.train.export import export_hf

    folder = save_moe(tmp_path / "model", layout)
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=False)
    materialize(lm, lm, torch.device("cpu"), files)
    exported = export_hf(lm.state_dict(), AutoConfig.from_pretrained(folder), tmp_path / "hf", tokenizer=None)
    names = stored_names(exported)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and GATE_UP not in names
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, lm(ids).logits)
    again, again_files = build_training_model(str(exported), vocab_size=VOCAB, packed=False)
    materialize(again, again, torch.device("cpu"), again_files)
    assert_equal_to_from_pretrained(dict(again.named_parameters()), folder)


def test_renamed_and_stacked_experts_of_another_moe_are_read_by_slices_too(tmp_path):
    """Mixtral (trained on padded plans): its checkpoints say `block_sparse_moe.experts.{e}.w1/w3/w2`, which
    transformers renames to `mlp.experts` and then stacks; both come from its conversion table."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model("mixtral", vocab_size=VOCAB, num_hidden_layers=2, num_local_experts=4, **shape)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "mixtral")
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in stored_names(tmp_path / "mixtral")
    lm, files = build_training_model(str(tmp_path / "mixtral"), vocab_size=VOCAB, packed=False)
    assert files is not None
    materialize(lm, lm, torch.device("cpu"), files)
    assert_equal_to_from_pretrained(dict(lm.named_parameters()), tmp_path / "mixtral")


def _read_on_ranks(folder: Path, out: Path) -> None:
    """One torchrun worker: shard the meta model with FSDP2, read this rank's rows, write what it holds; rank 0
    writes the gathered parameters."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from sftflow.tasks.train.fsdp import init_distributed, shard_model

    env = init_distributed("cpu")
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=True)
    root = shard_model(lm, env, torch.float32)
    if files is not None:
        materialize(root, lm, env.device, files)
    params = {name: p.full_tensor() for name, p in lm.named_parameters()}
    experts = lm.get_parameter(GATE_UP).to_local().shape[0]
    (out / f"rank{env.rank}.json").write_text(json.dumps({"experts": experts, "read_by_slices": files is not None}))
    if env.is_main:
        save_file(params, out / "params.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    _read_on_ranks(Path(sys.argv[1]), Path(sys.argv[2]))
    # Everything is written: leave as the training worker does, without the interpreter's teardown, where torch
    # 2.13's CPU build has been seen to abort a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
