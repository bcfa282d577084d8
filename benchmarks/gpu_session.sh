#!/usr/bin/env bash
# One lent GPU session's checks, as one command (the device tool runs it in the repository root with $OUT set):
# the GPU suite, then the CUDA benchmarks, each under its own time limit so that a slow step leaves the others their
# turn. Packages the GPU machine lacks, or has at other versions, travel as wheels in .whl (see the device tool's
# README; not huggingface_hub: transformers there, which torchmetrics imports, refuses 2.x); lm-zoo runs from the
# checkout, as the tests do. What each step prints goes to $OUT.
#
#     device run: bash benchmarks/gpu_session.sh [STEP ...]    (carry: .whl .gpudata; steps: windows training-step
#                                                               suite autocast cells cells-lm profile evaluation syncs fit nce generate
#                                                               xml; default all; ptb-word and ptb-char only when named,
#                                                               one a call: each trains a model for the registry)
#     device run: bash benchmarks/gpu_session.sh hop           (the next hop of the word model: training-step, then
#                                                               ptb-word, carrying on from .gpudata/start if there)
#     device run: bash benchmarks/gpu_session.sh measure       (the training step's measurements in one call, at most
#                                                               565 s of steps: windows cells cells-lm syncs fit generate)
#     device run: XML_CONFIG=configs/synthetic/xml-lstm-gpu-1024.yaml bash benchmarks/gpu_session.sh xml
#
# LM_ZOO_COMMIT=$(git rev-parse --short=12 HEAD) names the commit measured (the results files record it): the copy
# there is a working tree, its git not this checkout's.
# The tool brings back 8 files at most, each under 16 MiB: name few steps per call when one of them is xml.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    rm -rf /tmp/site  # a warm machine keeps the last call's
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# The tests that start `lm-zoo` find it on the PATH, as an installed checkout would have it.
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from cli import main; sys.exit(main())" "$@"\n' >/tmp/bin/lm-zoo
chmod +x /tmp/bin/lm-zoo
export PATH=/tmp/bin:$PATH
# The corpora the benchmarks read (PTB's word and character files, the GBW sample), copied into .gpudata and carried,
# when there and $LM_ZOO_DATA does not name others.
if [ -z "${LM_ZOO_DATA:-}" ] && [ -d .gpudata ]; then export LM_ZOO_DATA=$PWD/.gpudata; fi

{
    nvidia-smi -L
    python3 -c "import torch, lightning, huggingface_hub; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'lightning', lightning.__version__, 'hub', huggingface_hub.__version__,
torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

want() {  # want STEP: whether the command line asked for it (none named: every step)
    [ $# -gt 0 ] && { [ ${#STEPS[@]} -eq 0 ] || [[ " ${STEPS[*]} " == *" $1 "* ]]; }
}
STEPS=("$@")
if [ "${STEPS[*]:-}" = measure ]; then STEPS=(windows cells cells-lm syncs fit generate); fi
# The next hop of the word model, as a GPU session's first call: the captured step's test, then the registry run
# (uncaptured if that test failed), carrying on from .gpudata/start when the last shipped export was copied there.
HOP=
if [ "${STEPS[*]:-}" = hop ]; then
    STEPS=(training-step ptb-word) HOP=1
    if [ -z "${START:-}" ] && [ -f .gpudata/start/config.json ]; then export START=$PWD/.gpudata/start; fi
    if [ -n "${START:-}" ]; then echo "== hop: carrying on from $START"; else echo "== hop: a fresh run"; fi
fi

step() {  # step SECONDS LOGNAME COMMAND...: run it under a limit, its output in $OUT/LOGNAME and on stdout
    local limit=$1 log=$2
    shift 2
    echo "== $* (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    echo "== rc $rc after $((SECONDS - start))s"
    tail -n 25 "$OUT/$log"
    return $rc
}

# The captured windows and the captured training step first (zoo/window.py, lightning_modules/training_step.py):
# equal to their uncaptured paths, dropout, a Lightning fit.
want windows && step 100 gpu_windows.txt python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
    -k "captured or replay or per_step_cell"
# The captured training step alone, on lstm (3 optimizers), before a registry run trains with it: a call can run this
# first and train with LM_ZOO_TRAINING_STEP=direct when it fails.
if want training-step && ! step 90 gpu_training_step.txt python3 -m pytest -m gpu tests/test_gpu.py -q -rs \
    -p no:cacheprovider -k "captured_training_step and lstm" && [ -n "$HOP" ]; then
    echo "== the captured step failed its test: this hop trains uncaptured (LM_ZOO_TRAINING_STEP=direct)"
    export LM_ZOO_TRAINING_STEP=direct
fi
want suite && step 200 gpu_suite.txt python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
want autocast && step 45 autocast_dtypes.txt python3 benchmarks/autocast_dtypes.py --device cuda --out "$OUT/autocast_dtypes_cuda.json"
# Every cell against nn.LSTM, 20 steps queued between two synchronisations as training queues them, the median of 5
# rounds: the stack alone, then the whole language model (embedding, stack, PTB's 10,000-word softmax).
want cells && step 110 cells.txt python3 benchmarks/cells.py --device cuda --batch 20 64 --bptt 35 --rounds 5 \
    --queued 20 --no-naive --out "$OUT/cells_cuda.json"
want cells-lm && step 90 cells_lm.txt python3 benchmarks/cells.py --device cuda --batch 20 64 --bptt 35 --rounds 5 \
    --queued 20 --no-naive --vocab 10000 --out "$OUT/cells_lm_cuda.json"
want profile && step 90 cell_profile.txt python3 benchmarks/cell_profile.py --device cuda --arch mogrifier fs_rnn \
    on_lstm lstm_no_forget --batch 20 64 --out "$OUT/cell_profile_cuda.json"
want evaluation && step 60 evaluation_procedures.txt python3 benchmarks/evaluation_procedures.py --device cuda --tokens 2000
want syncs && step 45 host_syncs.txt python3 benchmarks/host_syncs.py --device cuda --out "$OUT/host_syncs_cuda.json"
# lm-zoo fit against the plain loop on the GPU (needs PTB's word files in .gpudata/ptb): the 2 x 200 recipe at
# batch 20, and 2 x 650 at batch 64; lm-zoo fit with its captured step, one window a step and 8, side by side.
want fit && step 80 fit_overhead.txt python3 benchmarks/fit_overhead.py --device cuda --rounds 1 --steps 200 \
    --data-root "${LM_ZOO_DATA:-.gpudata}" --out "$OUT/fit_overhead_cuda.json"
want fit && step 80 fit_overhead_650.txt python3 benchmarks/fit_overhead.py --device cuda --rounds 1 --steps 200 \
    --width 650 --batch 64 --data-root "${LM_ZOO_DATA:-.gpudata}" --out "$OUT/fit_overhead_cuda_650.json"
want nce && step 150 nce.txt python3 benchmarks/nce.py --device cuda --steps 3
# Sampling at batch 1: generate's captured step (zoo/sampling.py) and its plain path against a plain nn.LSTM loop.
want generate && step 60 generate_speed.txt python3 benchmarks/generate_speed.py --device cuda \
    --arch lstm mogrifier on_lstm skip_lstm --eager --out "$OUT/generate_speed_cuda.json"

pack_run() {  # pack_run RUN_DIR NAME: the run's logs and best checkpoint into $OUT as NAME.tgz.part-aa, -ab, ...
    # The optimizer's moments are dropped from the checkpoint (they only resume a run; the card reads its param
    # groups, which stay), and the archive is cut into 15 MiB pieces: the tool brings back no file over 16 MiB.
    # Here: cat NAME.tgz.part-* | tar -xz
    local run=$1 name=$2
    [ -f "$run/checkpoints/best.ckpt" ] || cp "$run/checkpoints/last.ckpt" "$run/checkpoints/best.ckpt"
    python3 - "$run/checkpoints/best.ckpt" <<'EOF'
import sys

import torch

path = sys.argv[1]
checkpoint = torch.load(path, map_location="cpu", weights_only=False)
for state in checkpoint.get("optimizer_states", []):
    state["state"] = {}
torch.save(checkpoint, path)
EOF
    rm -f "$run/checkpoints/last.ckpt"
    tar -czf /tmp/"$name".tgz "$run" && split -b 15M /tmp/"$name".tgz "$OUT/$name.tgz.part-"
    ls -l "$OUT"
}

# The XML task's GPU recipe for its few minutes (issue 32: >= 95% of sampled closing tags nest), the card's nesting
# measure split by span, and the run packed for `python -m release build` at home. XML_CONFIG names another recipe (its
# default_root_dir must be runs/synthetic/<its name>).
if want xml; then
    config=${XML_CONFIG:-configs/synthetic/xml-lstm-gpu.yaml}
    run=runs/synthetic/$(basename "$config" .yaml)/lightning_logs/version_0
    step 420 xml_fit.txt lm-zoo fit --config "$config"
    step 100 xml_nesting.txt python3 benchmarks/xml_nesting.py "$run/checkpoints/best.ckpt" \
        --out "$run/xml_nesting_gpu.json"
    pack_run "$run" xml_run
fi

# A model for the registry from a GPU recipe, in one call (only when named: each takes most of a call's 10 minutes):
# lm-zoo fit under the recipe's max_time, then its chosen (lowest validation loss) checkpoint exported as float16
# shards of at most 15 MiB, its validation figure measured on those stored weights on the GPU. What comes back: the
# shards themselves, and NAME_rest.tgz with the rest of the export, the run's logs (TensorBoard events, config.yaml)
# and this step's own logs; with env.txt that is at most 8 files. At home:
#     mkdir back && tar -xzf NAME_rest.tgz -C back && cp model-*.safetensors back/NAME/export/
#     python -m release build NAME --ckpt back/NAME/export --logs back/NAME/logs --config RECIPE --dtype float16 ...
# A later hop of the same run: START names the export it carries on from (the newest shipped revision, copied into
# a carried folder such as .gpudata/start: pretrained/ stays behind), given to checkpoints.callbacks.InitialWeights
# with carry_on (epochs, steps, learning rate and averaging go on from its record); bundle what comes back with
# `python -m release build ... --continues <the commit that bundled START>`, so that its card lists every hop's run.
# For the suite's tiny CPU run of this step (tests/test_gpu_recipes.py): RUN_ROOT moves the run (default: the
# recipe's default_root_dir), STAGING the archive's folder (default /tmp), FIT_ARGS adds options to lm-zoo fit,
# SHARD_SIZE and EXPORT_DEVICE change the export's.
registry_run() {  # registry_run RECIPE NAME
    local recipe=$1 name=$2
    local root=${RUN_ROOT:-$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['default_root_dir'])" "$recipe")}
    [ -n "$root" ] || return 1
    local staging=${STAGING:-/tmp}
    local keep=$staging/$name
    rm -rf "$keep" "$root" && mkdir -p "$keep/logs"
    local results=$OUT
    OUT=$keep/logs  # the step logs go into the archive, not one file each
    local hop=()
    if [ -n "${START:-}" ]; then
        hop=(--trainer.callbacks+=checkpoints.callbacks.InitialWeights "--trainer.callbacks.source=$START"
            --trainer.callbacks.carry_on=true)
    fi
    # shellcheck disable=SC2086  # FIT_ARGS is a list of options
    step 540 fit.txt lm-zoo fit --config "$recipe" --trainer.default_root_dir="$root" "${hop[@]}" ${FIT_ARGS:-}
    local fitted=$?
    local run=$root/lightning_logs/version_0
    step 120 export.txt lm-zoo export "$run/checkpoints/best.ckpt" --out "$keep/export" --dtype float16 \
        --max-shard-size "${SHARD_SIZE:-15MiB}" --splits valid --device "${EXPORT_DEVICE:-auto}" --json
    local exported=$?
    OUT=$results
    cp -r "$run" "$keep/logs/run" && rm -rf "$keep/logs/run/checkpoints"
    local shards=("$keep"/export/model-*-of-*.safetensors)
    [ -e "${shards[0]}" ] || shards=("$keep/export/model.safetensors")
    mv "${shards[@]}" "$OUT/"
    tar -czf "$OUT/${name}_rest.tgz" -C "$staging" "$name"  # what there is, the logs of a failed step too
    ls -l "$OUT"
    # The device tool brings back 8 files: at 522b546 a model of 6 shards left its logs behind.
    local files=("$OUT"/*)
    [ ${#files[@]} -le 8 ] || echo "== $OUT holds ${#files[@]} files: the tool brings back 8, the logs may stay behind"
    [ "$fitted" -eq 0 ] && [ "$exported" -eq 0 ]
}
named() {  # named STEP: the command line named it (these steps are never part of "all")
    [[ " ${STEPS[*]} " == *" $1 "* ]]
}
if named ptb-word; then registry_run configs/ptb/awd-lstm-gpu.yaml ptb_word; fi
if named ptb-char; then registry_run configs/ptb-char/awd-lstm-gpu.yaml ptb_char; fi
