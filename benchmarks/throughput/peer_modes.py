"""The peers' modes: A (HF + TRL's padded batches), B / C / Cac / Clac (FSDP, torch varlen_attn, Liger), Cl / Cn /
Cnac (one GPU, no FSDP), Lp (peft LoRA); and what they share: the attention registered with transformers, Liger's
kernels and fused linear cross-entropy, a peer's training step."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from throughput.bench import BenchCore
from throughput.common import (
    BASELINE_ATTENTION,
    LORA_RANK,
    batch_tokens,
    compile_layers,
    dynamo_stats,
    packed_rows,
    padded_batches,
    shard_like_worker,
    step_totals,
)

# ---------------------------------------------------------------------------------------------------------------------
# baselines B and C: torch varlen_attn as a transformers attention function, Liger's fused linear cross-entropy
# ---------------------------------------------------------------------------------------------------------------------


def register_fa4_baseline_attention() -> str:
    """Register FlashAttention-4 as a peer's attention, the way its users call it: `flash_attn.cute`'s
    `flash_attn_varlen_func` in a transformers attention function, GQA native, outside the compiled graph (its
    autograd function does not trace)."""
    from flash_attn.cute import flash_attn_varlen_func
    from transformers import AttentionInterface

    @torch.compiler.disable
    def attend(q, k, v, cu, max_len, scaling):
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
            softmax_scale=scaling, causal=True,
        )[0]  # fmt: skip

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
        if torch.is_autocast_enabled("cuda"):  # as for torch varlen_attn below: RoPE promoted q and k to fp32
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (x.to(dtype) for x in (q, k, v))
        return attend(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scaling).unsqueeze(0), None

    AttentionInterface.register(BASELINE_ATTENTION, attention)
    return "FlashAttention-4 flash_attn_varlen_func (GQA native, outside the graph)"


def register_baseline_attention(device: torch.device, kind: str = "torch") -> str:
    """Register `bench_torch_varlen` (torch `varlen_attn`, causal within each document; `kind="fa4"`:
    FlashAttention-4). Returns what it runs.

    The signature is inspected here, once, so the function itself stays free of Python introspection (compile)."""
    from transformers import AttentionInterface

    if kind == "fa4":
        return register_fa4_baseline_attention()

    if device.type != "cuda":  # CPU plumbing runs only: the block-diagonal SDPA reference
        from sftflow.kernels.attention import varlen_attention

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            out = varlen_attention(
                query.squeeze(0).transpose(0, 1),
                key.squeeze(0).transpose(0, 1),
                value.squeeze(0).transpose(0, 1),
                kwargs["cu_seq_lens_q"],
                kwargs["max_length_q"],
                scaling,
                backend="sdpa",
            )
            return out.unsqueeze(0), None

        AttentionInterface.register(BASELINE_ATTENTION, attention)
        return "sdpa block-diagonal reference (CPU)"

    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        # squeeze, as sftflow's attention function does (a select's backward copies each gradient into zeros)
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
        if torch.is_autocast_enabled("cuda"):
            # RoPE's fp32 cos/sin promote q and k under autocast; a custom op is not autocast, so cast as HF's own
            # flash-attention path does
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (x.to(dtype) for x in (q, k, v))
        extra = dict(causal)
        if gqa:
            extra["enable_gqa"] = True
        elif q.shape[1] != k.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **extra)
        return out.unsqueeze(0), None

    AttentionInterface.register(BASELINE_ATTENTION, attention)
    return f"torch varlen_attn ({'enable_gqa' if gqa else 'repeated KV'}, {next(iter(causal))})"


def peer_step(
    model, optimizer, scheduler, b: dict, device, grad_clip: float, autocast: bool, params=None
) -> tuple[int, float]:
    """One optimizer step of a baseline on one packed row (`LigerRoot` returns the loss sum), as a training loop of
    its users runs it; `autocast`: bf16 autocast around the forward (fp32 weights); `params`: those clipped (default
    all of the model's)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss_sum = model(
            input_ids=b["input_ids"].to(device, non_blocking=True),
            position_ids=b["position_ids"].to(device, non_blocking=True),
            labels=b["labels"].to(device, non_blocking=True),
            cu_seqlens=b["cu_seqlens"].to(device, non_blocking=True),
            max_seqlen=int(b["max_seqlen"]),
        )
    (loss_sum / max(b["num_loss_tokens"], 1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters() if params is None else params, grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return batch_tokens(b)


@contextlib.contextmanager
def liger_llama_kernels(enabled: bool):
    """Liger's Llama kernels (RoPE, RMSNorm, SwiGLU; the fused linear CE is `LigerRoot`'s) for the models built inside.
    Liger patches the modeling module's classes and functions; they are restored afterwards so that the other modes
    of this process build the stock modules."""
    if not enabled:
        yield
        return
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    patched = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {attr: getattr(modeling_llama, attr) for attr in patched}
    try:
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
        )
        yield
    finally:
        for attr, value in saved.items():
            setattr(modeling_llama, attr, value)


class LigerRoot(nn.Module):
    """FSDP root for B/C: the base model to the final hidden states, then Liger's fused linear CE (sum)."""

    def __init__(self, lm: nn.Module, device: torch.device):
        super().__init__()
        self.lm = lm
        if device.type == "cuda":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            self.loss_name = "liger fused linear CE"
        else:  # CPU plumbing runs only

            def logits_ce(weight, hidden, labels):
                return nn.functional.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")

            self.loss = logits_ce
            self.loss_name = "F.cross_entropy on logits (CPU)"

    def forward(self, input_ids, position_ids, labels, cu_seqlens, max_seqlen):
        out = self.lm.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
        )
        hidden = out.last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        return self.loss(weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


class PeerModes(BenchCore):
    # -- A ------------------------------------------------------------------------------------------------------------
    def mode_a(self) -> dict:
        """What the HF Trainer / TRL run on one GPU with bf16=True: the plain model with fp32 weights under bf16
        autocast (no FSDP), the same AdamW. A batch that runs out of memory is skipped and counted."""
        args = self.args
        batches = padded_batches(self.plan, self.dataset, args.warmup + args.steps, args.padded_batch)
        model = self.build_lm("sdpa", packed_worker=False)
        self.set_shape(model)
        optimizer, scheduler = self.optimizer(model)
        device = self.device
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

        def step(i):
            b = batches[i]
            with autocast:
                out = model(
                    input_ids=b["input_ids"].to(device, non_blocking=True),
                    attention_mask=b["attention_mask"].to(device, non_blocking=True),
                    labels=b["hf_labels"].to(device, non_blocking=True),
                    use_cache=False,
                )
            out.loss.backward()
            del out
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.optim_c.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return batch_tokens(b)

        self.on_oom = lambda: optimizer.zero_grad(set_to_none=True)
        padded = sum(b["input_ids"].numel() for b in batches[args.warmup :])
        real = sum(batch_tokens(b)[0] for b in batches[args.warmup :])
        extra = {
            "what": "HF sdpa + padding mask, 8 docs/batch padded to longest, HF loss on logits, bf16 autocast, no FSDP",
            "pad_efficiency": real / padded,
        }
        try:
            return self.timed("A", step, args.warmup, args.steps, extra)
        finally:
            self.on_oom = None

    # -- B / C --------------------------------------------------------------------------------------------------------
    def mode_bc(self, compiled: bool, checkpointing: bool = False, liger_all: bool = False) -> dict:
        args = self.args
        name = ("Cac" if checkpointing else "C") if compiled else "B"
        name = "Clac" if liger_all else name
        warmup = args.compile_warmup if compiled else args.warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps, rank=self.env.rank)
        totals = step_totals(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(self.device, self.peer_attention)
        with liger_llama_kernels(liger_all):
            lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False)
        self.set_shape(lm)
        if compiled:
            torch._dynamo.reset()
            compile_layers(lm)
        if checkpointing:  # what transformers users turn on: every decoder layer, non-reentrant
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        root = LigerRoot(lm, self.device)
        model = shard_like_worker(root, lm, self.env, self.param_dtype)
        optimizer, scheduler = self.optimizer(model)
        device = self.device

        def step(i):
            # each rank's loss is its own rows' mean, and FSDP averages the gradients: how its users train
            peer_step(model, optimizer, scheduler, rows[i], device, self.optim_c.grad_clip, autocast=False)
            return totals[i]

        extra = {
            "what": f"{attention}, "
            + ("Liger RoPE/RMSNorm/SwiGLU + " if liger_all else "")
            + root.loss_name
            + (", compiled layers (dynamic)" if compiled else "")
            + (", gradient checkpointing (every layer)" if checkpointing else "")
        }
        result = self.timed(name, step, warmup, args.steps, extra)
        if compiled:
            result["dynamo"] = dynamo_stats()
        return result

    # -- Cl: the one-GPU peer with Liger's full kernel set ---------------------------------------------------------
    def mode_one_gpu_peer(self, liger_all: bool, compiled: bool, checkpointing: bool = False) -> dict:
        name = ("Cl" if liger_all else "Cn") + ("ac" if checkpointing else "")
        if self.device.type != "cuda":
            raise ValueError(f"mode {name} needs CUDA (Liger's kernels)")
        args = self.args
        warmup = args.compile_warmup if compiled else args.warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(self.device, self.peer_attention)
        with liger_llama_kernels(liger_all):
            lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False)
        self.set_shape(lm)
        if compiled:
            torch._dynamo.reset()
            compile_layers(lm)
        if checkpointing:  # what transformers users turn on: every decoder layer, non-reentrant
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = LigerRoot(lm, self.device)
        c = self.optim_c
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=True
        )
        scheduler = self.scheduler(optimizer)
        device = self.device

        def step(i):
            return peer_step(model, optimizer, scheduler, rows[i], device, c.grad_clip, autocast=True)

        kernels = "Liger RoPE/RMSNorm/SwiGLU + " if liger_all else ""
        extra = {
            "what": f"no FSDP, fp32 weights + bf16 autocast, {kernels}{model.loss_name}, {attention}, "
            + ("compiled layers (dynamic), " if compiled else "eager, ")
            + ("gradient checkpointing (every layer), " if checkpointing else "")
            + "torch fused AdamW"
        }
        result = self.timed(name, step, warmup, args.steps, extra)
        if compiled:
            result["dynamo"] = dynamo_stats()
        return result

    # -- Lp: LoRA as its users run it -----------------------------------------------------------------------------
    def mode_lora_peer(self, checkpointing: bool = False) -> dict:
        """LoRA the common way on one GPU: the Hugging Face model in bf16, `peft.get_peft_model` (rank 16 on all linear
        layers, adapters in fp32), bf16 autocast, the packed rows with torch `varlen_attn`, Liger's fused linear CE,
        compiled decoder layers, no FSDP, torch's fused AdamW over the adapters."""
        from peft import LoraConfig, get_peft_model

        args, device = self.args, self.device
        warmup = args.compile_warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(device, self.peer_attention)
        lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False).to(torch.bfloat16)
        self.set_shape(lm, lora=True)
        peft_config = LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        get_peft_model(lm, peft_config)  # injects the adapters into `lm` in place and freezes the rest
        torch._dynamo.reset()
        compile_layers(lm)
        if checkpointing:  # what peft users turn on when the model does not fit: every decoder layer, non-reentrant
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        root = LigerRoot(lm, device)
        trained = [p for p in root.parameters() if p.requires_grad]
        c = self.optim_c
        optimizer = torch.optim.AdamW(
            trained, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=device.type == "cuda"
        )
        scheduler = self.scheduler(optimizer)
        autocast = device.type == "cuda"

        def step(i):
            return peer_step(root, optimizer, scheduler, rows[i], device, c.grad_clip, autocast, params=trained)

        extra = {
            "what": f"peft LoRA r{LORA_RANK} all-linear on a bf16 model, bf16 autocast, {attention}, {root.loss_name}, "
            "compiled layers (dynamic), "
            + ("gradient checkpointing (every layer), " if checkpointing else "")
            + "no FSDP",
            "trained_params": sum(p.numel() for p in trained),
        }
        result = self.timed("Lpac" if checkpointing else "Lp", step, warmup, args.steps, extra)
        result["dynamo"] = dynamo_stats()
        return result
