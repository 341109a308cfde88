#!/usr/bin/env bash
# The FlashAttention-4 GPU suite on one Hopper GPU, in priority order: the backend's GPU tests, the 1B training
# benchmark on packed 16k rows and on 32k rows of long documents (sftflow with FA4 and with its Triton kernels, the
# one-GPU peer with FA4, same process), the attention kernels, the model families on FA4, the other GPU tests.
#
#   bash benchmarks/fa4_suite.sh LOGDIR [STEP ...]   # flash-attn-4 and sftflow importable (pip install -e ".[hopper]")
#
# STEPs (default: all, in this order): tests_fa4 train_16k train_32k_long attention_packed attention_long
# tests_families train_32k_long_triton tests_gpu_other; also train_64k_long (64k rows against the peer with
# checkpointing), train_8b_lora_16k (8B LoRA against peft with checkpointing, which it needs to fit an H100),
# train_8b_full_16k and train_8b_full_16k_dac (8B full fine-tuning, which needs an H200: sftflow with 26 of 32 layers
# checkpointed, what `activation_checkpointing: auto` picks there, and with all of them, against the FSDP peer with
# FA4 and gradient checkpointing), workload_8b_16k (the same 8B run as a user runs it, `sftflow plan` and
# `sftflow train` on benchmarks/workloads/llama8b-16k.yaml, then that peer), workload_8b_16k_inbwd (the same with the
# optimizer in the backward and 8 layers' moments on the host, its fastest measured setting, then the same peer),
# workload_1b_16k (the 1B on packed 16k rows as a user runs it, against the FA4 peer), workload_1b_64k (the 1B
# at 64k rows of long documents as a user runs it, against the FA4 peer with checkpointing), cost_table (the
# planner's cost table for the 1B at 64k rows on this GPU; cost_table_quick: five lengths, 3 steps each) and
# tests_gpu (tests/gpu: the training stage through its launcher, crash, resume, export).
# Each writes LOGDIR/<step>.log (and its benchmark's JSON/Markdown) and appends
# "<step> rc=<code> <seconds>s" to LOGDIR/progress.txt; LOGDIR/DONE marks the end. Steps run under `timeout`, so one
# that hangs costs its limit and no more. Figures from it are recorded in
# benchmarks/RESULTS.md with the date, GPU and versions.
set -u
LOG=${1:?usage: fa4_suite.sh LOGDIR [STEP ...]}
shift
STEPS=${*:-tests_fa4 train_16k train_32k_long attention_packed attention_long tests_families train_32k_long_triton tests_gpu_other}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$LOG/../fa4-cache}
TT="python3 benchmarks/train_throughput.py --preset llama1b --compile-warmup 8 --warmup 4 --profile-steps 3 --jsonl $LOG/rows.jsonl"
LONG32="--row-tokens 32768 --median-length 16384 --min-length 4096 --max-length 32768"
LONG64="--row-tokens 65536 --median-length 16384 --min-length 4096 --max-length 65536"
ATT="python3 benchmarks/attention.py --variants flash_attn_4 fa4-nondet fa4-direct triton torch"
SHAPES="32,8,64;16,4,128;16,8,256"

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name: $*" | tee -a "$LOG/progress.txt"
  timeout -k 10 "$limit" "$@" >"$LOG/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$LOG/progress.txt"
}

python3 - >"$LOG/env.txt" 2>&1 <<'PY'
import importlib.metadata as md, platform, torch, triton
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), "torch", torch.__version__, "triton",
      triton.__version__, "python", platform.python_version())
for name in ("flash-attn-4", "nvidia-cutlass-dsl", "transformers", "liger-kernel"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "absent")
from sftflow.kernels.attention import select_backend
print(select_backend("cuda", torch.bfloat16, 64))
PY

for s in $STEPS; do
  case $s in
    tests_fa4) step "$s" 480 python3 -m pytest -q tests/kernels/test_attention_fa4.py -p no:cacheprovider ;;
    train_16k) step "$s" 560 $TT --modes D,Cn@fa4,D@triton --steps 100 --out "$LOG/$s" ;;
    train_16k_peer) step "$s" 300 $TT --modes D,Cn@fa4 --steps 100 --out "$LOG/$s" ;;
    train_32k_long_peer) step "$s" 300 $TT --modes D,Cn@fa4 --steps 40 $LONG32 --out "$LOG/$s" ;;
    train_32k_long) step "$s" 590 $TT --modes D,Cn@fa4 --steps 100 $LONG32 --out "$LOG/$s" ;;
    train_64k_long) step "$s" 590 $TT --modes D,Cnac@fa4 --steps 100 --profile-steps 0 $LONG64 --out "$LOG/$s" ;;
    train_8b_lora_16k) step "$s" 590 $TT --preset llama8b --modes L,Lpac@fa4 --steps 100 --compile-warmup 6 --warmup 3 \
      --profile-steps 0 --out "$LOG/$s" ;;
    train_8b_full_16k) step "$s" 590 $TT --preset llama8b --modes D26,Cac@fa4 --steps 100 --compile-warmup 6 \
      --warmup 3 --profile-steps 0 --out "$LOG/$s" ;;
    train_8b_full_16k_dac) step "$s" 400 $TT --preset llama8b --modes Dac --steps 100 --compile-warmup 6 --warmup 3 \
      --profile-steps 0 --out "$LOG/$s" ;;
    workload_8b_16k) step "$s" 800 python3 benchmarks/workload.py llama8b-16k --steps 110 --warmup 10 --jsonl "$LOG/rows.jsonl" \
      --baseline Cac@fa4 --work /tmp/wl8b --out "$LOG/$s" ;;
    workload_8b_16k_inbwd) step "$s" 840 python3 benchmarks/workload.py llama8b-16k --steps 110 --warmup 10 --jsonl "$LOG/rows.jsonl" \
      --set train.optimizer.in_backward=true --set train.optimizer.grad_clip=null --set train.optimizer.offload=8 \
      --baseline Cac@fa4 --work /tmp/wl8b-inbwd --out "$LOG/$s" ;;
    workload_1b_16k) step "$s" 420 python3 benchmarks/workload.py llama1b-16k --steps 110 --warmup 10 --jsonl "$LOG/rows.jsonl" \
      --baseline Cn@fa4 --work /tmp/wl1b16 --out "$LOG/$s" ;;
    workload_1b_64k) step "$s" 800 python3 benchmarks/workload.py llama1b-64k --steps 110 --warmup 10 --jsonl "$LOG/rows.jsonl" \
      --baseline Cnac@fa4 --work /tmp/wl1b --out "$LOG/$s" ;;
    train_32k_long_triton) step "$s" 300 $TT --modes D@triton --steps 40 $LONG32 --out "$LOG/$s" ;;
    cost_table) step "$s" 480 python3 benchmarks/cost_table.py --preset llama1b --steps 4 --warmup 1 \
      --jsonl "$LOG/rows.jsonl" --out "$LOG/$s" ;;
    cost_table_quick) step "$s" 300 python3 benchmarks/cost_table.py --preset llama1b --steps 3 --warmup 1 \
      --lengths 256,1024,4096,16384,65536 --jsonl "$LOG/rows.jsonl" --out "$LOG/$s" ;;
    attention_packed) step "$s" 300 $ATT --docs packed --shapes "$SHAPES" --out "$LOG/attention.md" ;;
    attention_long) step "$s" 300 $ATT --docs long --shapes "$SHAPES" --out "$LOG/attention.md" ;;
    tests_families) step "$s" 480 python3 -m pytest -q tests/tasks/train/test_families.py -k flash_attn_4 -p no:cacheprovider ;;
    tests_families_a) step "$s" 300 python3 -m pytest -q tests/tasks/train/test_families.py -p no:cacheprovider \
      -k "flash_attn_4 and (phi4_mini or mistral or gemma3)" ;;
    tests_families_b) step "$s" 300 python3 -m pytest -q tests/tasks/train/test_families.py -p no:cacheprovider \
      -k "flash_attn_4 and (qwen2_5 or qwen3_moe or smollm3)" ;;
    tests_gpu_other) step "$s" 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/tasks/train/test_activations.py \
      tests/tasks/train/test_single_device.py tests/tasks/train/test_train_step.py ;;
    tests_gpu) step "$s" 590 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu ;;
    *) echo "unknown step $s" | tee -a "$LOG/progress.txt" ;;
  esac
done
touch "$LOG/DONE"
