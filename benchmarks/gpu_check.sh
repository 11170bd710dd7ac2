#!/usr/bin/env bash
# What a GPU changes, checked in one go: at most 8 minutes on one GPU, one table at the end.
#
#   bash benchmarks/gpu_check.sh            (from anywhere; PYTHON=... picks the interpreter)
#
# Rows: the default run on cuda; trainer.precision=bf16 and fp16; trainer.compile=true;
# parallel=fsdp with one process; a real CUDA out-of-memory error that the back-off recovers
# from (an MLP whose first batch is sized from the GPU's memory to exceed it); a checkpoint of the
# unfused optimizer resumed by the fused one, on one device and under fsdp; task=doctor with
# GPUtil's readings; benchmarks/step_overhead.py on the GPU. Each row runs as a user types it,
# with a time limit of its own inside the 8 minutes; a row that fails says so in the table and
# the others still run. Its runs and logs stay in the folder the last line names. Exit status:
# 0 when every row passed, 1 when one failed, 2 when there is no GPU (checked before anything runs).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # 8 minutes, less the table and the start

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one." >&2
    exit 2
fi

OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
START=$SECONDS
ROWS=()
FAILED=0
QUIET=(device=cuda trainer.progress_bar=false)

# The time a row may take: its own limit, or what is left of the budget.
limit() {
    local left=$((BUDGET_S - (SECONDS - START)))
    echo $(($1 < left ? $1 : left))
}

# row NAME SECONDS COMMAND...: runs the command (its output to $OUT/NAME.log) and adds a row with
# what `summary NAME` reads from the run; a command that fails, or runs out of time, is a FAIL.
row() {
    local name=$1 seconds; seconds=$(limit "$2"); shift 2
    if ((seconds < 15)); then
        ROWS+=("$name|skipped|the 8-minute budget is spent"); return
    fi
    local started=$SECONDS status=ok detail code=0
    timeout -k 20 "$seconds" "$@" >"$OUT/$name.log" 2>&1 || code=$?
    if ((code == 124)); then
        status=FAIL detail="it ran out of its $seconds s"
    elif ((code)); then
        status=FAIL detail="exit $code: $(tail -n 1 "$OUT/$name.log" | cut -c1-150)"
    elif ! detail=$(summary "$name" 2>>"$OUT/$name.log"); then
        status=FAIL detail=$(tail -n 1 "$OUT/$name.log" | cut -c1-150)
    fi
    [[ $status == ok ]] || FAILED=1
    ROWS+=("$name|$status, $((SECONDS - started)) s|$detail")
}

# summary NAME: one line of figures from the row's run dir ($OUT/NAME) or log.
summary() {
    "$PYTHON" - "$OUT" "$1" <<'PY'
import json, re, sys
from pathlib import Path
out, name = Path(sys.argv[1]), sys.argv[2]
run, log = out / name, (out / f"{name}.log").read_text()
if name == "doctor":
    report = json.loads((run / "doctor.json").read_text())
    gpus = report["environment"].get("gpus") or []
    readings = "; ".join(f"GPUtil: {g['name']} load {g['load_percent']}%, {g['memory_used_mb']:.0f}/{g['memory_total_mb']:.0f} MB"
                         for g in gpus) or "GPUtil: no readings"
    print(f"{readings}; largest micro-batch {report['largest_batch'].get('largest_micro_batch')}")
elif name == "step_overhead":
    ratios = re.findall(r"^\s+(runlab \w+) / (hand-written[^:]*): (\S+x)", log, re.M)
    if not ratios:
        sys.exit("step_overhead printed no ratio")
    print("; ".join(f"{way} / {floor}: {ratio}" for way, floor, ratio in ratios))
else:
    metrics = json.loads((run / "metrics.json").read_text())
    figures = [f"val/acc {metrics['val/acc']:.3f}" if "val/acc" in metrics else "",
               f"{metrics['samples_per_second']:,.0f} samples/s"]
    if name == "oom":
        if not metrics.get("troubleshoot/oom_backoffs"):
            sys.exit("no out-of-memory error happened: nothing was recovered")
        first = re.search(r"Out of memory at micro-batch (\d+) \((.*?)\)\. Retrying", log)
        if "CUDA out of memory" not in first.group(2):
            sys.exit(f"the back-off recovered from another error than CUDA's: {first.group(2)[:100]}")
        backoffs = metrics["troubleshoot/oom_backoffs"]
        figures = [f"CUDA out of memory at micro-batch {first.group(1)}, trained at {metrics['troubleshoot/micro_batch']} "
                   f"after {backoffs} back-off{'s' if backoffs > 1 else ''}", figures[1]]
    print(", ".join(filter(None, figures)))
PY
}

# The out-of-memory run: one step of an MLP of width 32768 on 1024 features, its batch the power of
# two whose activations (about 16 bytes per hidden unit and sample) take 1.5 times the GPU's memory.
OOM_BATCH=$("$PYTHON" -c 'import math, torch
total = torch.cuda.get_device_properties(0).total_memory
print(2 ** math.ceil(math.log2(1.5 * total / (16 * 32768))))')
OOM_SAMPLES=$((OOM_BATCH * 105 / 100))  # the train split (98%) holds one whole batch

row default 60 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=3 hydra.run.dir="$OUT/default"
row bf16 60 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=3 trainer.precision=bf16 hydra.run.dir="$OUT/bf16"
row fp16 60 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=3 trainer.precision=fp16 hydra.run.dir="$OUT/fp16"
row compile 150 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=3 trainer.compile=true hydra.run.dir="$OUT/compile"
if [[ -f conf/parallel/fsdp.yaml ]]; then
    row fsdp 60 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=3 parallel=fsdp parallel.world_size=1 hydra.run.dir="$OUT/fsdp"
else
    ROWS+=("fsdp|skipped|parallel=fsdp is not in this checkout (no conf/parallel/fsdp.yaml)")
fi
row oom 150 "$PYTHON" run.py "${QUIET[@]}" data=synthetic data.num_samples="$OOM_SAMPLES" "data.input_shape=[1024]" \
    data.val_fraction=0.01 data.test_fraction=0.01 data.device_cache_mb=16384 data.eval_batch_size=4096 \
    model=mlp model.width=32768 model.depth=1 batch_size="$OOM_BATCH" trainer.max_steps=1 \
    trainer.test_after_fit=false logger=none checkpoint.enabled=false hydra.run.dir="$OUT/oom"
# A checkpoint of the unfused optimizer resumed by the fused one (optimizer.fused, the default): its step
# counts must reach the GPU, where the fused update reads them.
row resume_fused 120 bash -c "$(printf '%q ' "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=1 optimizer.fused=false \
    hydra.run.dir="$OUT/unfused") && $(printf '%q ' "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=2 \
    resume="$OUT/unfused/checkpoints/last.pt" hydra.run.dir="$OUT/resume_fused")"
# The same under parallel=fsdp, whose AdamW is fused over its sharded parameters.
if [[ -f conf/parallel/fsdp.yaml ]]; then
    row resume_fused_fsdp 60 "$PYTHON" run.py "${QUIET[@]}" trainer.max_epochs=2 parallel=fsdp parallel.world_size=1 \
        resume="$OUT/unfused/checkpoints/last.pt" hydra.run.dir="$OUT/resume_fused_fsdp"
fi
row doctor 90 "$PYTHON" run.py task=doctor device=cuda hydra.run.dir="$OUT/doctor"
row step_overhead 150 "$PYTHON" benchmarks/step_overhead.py --device cuda --epochs 30 --rounds 3

echo
echo "gpu_check.sh on $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))'), $((SECONDS - START)) s:"
printf '%s\n' "${ROWS[@]}" | column -t -s '|' -N "check,result,figures" 2>/dev/null || printf '%s\n' "${ROWS[@]}"
echo "runs and logs: $OUT"
exit $FAILED
