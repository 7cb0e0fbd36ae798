#!/usr/bin/env bash
# The whole GPU benchmark in one device call, run from the repository root with $OUT set:
#
#   bash bench/h200.sh setup step reference load:1,10,20,40 profile:"--rates 10,20 --duration 20" savecache
#
# with the device call carrying ".carry" (wheels in .carry/whl and .carry/refwhl, the tokenizer cache in
# .carry/voxgate_cache, and optionally an earlier call's compile_cache.txz as .carry/compile_cache.txz);
# bench/carry.sh builds .carry/whl, .carry/optwhl (PyAV: only for --clone or compressed formats),
# .carry/voxgate_cache and .carry/nari (the peer's harness, for the nari step).
# Steps run in the order given; a failing step is reported and the next one still runs, and the script exits
# non-zero if any failed.
#
#   setup            install .carry/whl into /tmp/site, build the random 1.7B checkpoint in /tmp/ckpt once
#   step[:ARGS]      bench/engine_step.py ARGS           -> $OUT/engine_step.json (then engine_step_2.json...)
#   reference        qwen-tts 0.1.1 from .carry/refwhl   -> $OUT/reference.json
#   load:RATES       bench/engine_load.py --rates RATES  -> $OUT/engine_load.json (WARMUP, DURATION, SEED or SEEDS,
#                    LOAD_ARGS for extra flags such as "-o key=value", VARIANTS for engine_load's --variant
#                    runs on the same server, separated by ';'); where the engine runs, e.g.
#                      WARMUP=5 DURATION=30 LOAD_ARGS=--worker bash bench/h200.sh setup load:10,20
#                      LOAD_ARGS="--tcp-workers 2" bash bench/h200.sh setup load:10,20
#                    (the second: two `voxgate worker` engines on the GPU, 64 KV slots each, on loopback TCP with
#                    a token, behind the gateway's static pool; their logs are gateway.worker1.log, .worker2.log)
#                    the agent workload (3 sentences per session streamed word by word, bench/README.md):
#                      LOAD_ARGS="--worker --agent-sentences 3 --words-per-s 40 --granularity token --keep-going" \
#                        bash bench/h200.sh setup load:1,5,10,12
#   nari:RATES[ FLAGS] bench/nari_load.py --rates RATES FLAGS -> $OUT/nari_load.json (then nari_load_2.json...): the peer's own harness (nari-labs
#                    tts_bench, its vllm-omni target, ARCTIC prompts) at each rate against the gateway and one
#                    `voxgate worker` (engine_load's --worker run, its engine flags), one harness command a rate:
#                    per rate its p50/p95 audible TTFA, underrunning requests and failures, and the engine's
#                    counters (WARMUP, DURATION, SEED; NARI_ARGS for extra flags such as "-o key=value"). Needs
#                    .carry/nari (bench/carry.sh), not .carry/optwhl; issue 29's table in one call:
#                      bash bench/h200.sh setup nari:1,10,20,60,80,100 savecache
#                    carrying .carry/whl .carry/voxgate_cache .carry/nari .carry/compile_cache.txz
#   multigpu:RATE[ FLAGS] issue 35 on a two-GPU host (kind nvidia-h100-x2), four bench/nari_load.py runs, each
#                    its own `voxgate worker --gpus` launcher behind the gateway's static pool (TCP, token file):
#                      --gpus 0   at RATE                               -> $OUT/multigpu_1gpu.json (the baseline)
#                      --gpus 0,1 at 2xRATE                             -> $OUT/multigpu_2gpu.json (the scaling)
#                      --gpus 0,1 at 2xRATE, --kill-worker-at KILL_AT   -> $OUT/multigpu_kill.json
#                      --gpus 0,1 at 2xRATE, --drain-worker-at KILL_AT  -> $OUT/multigpu_drain.json
#                    (GPUS=0,1 names the pair; KILL_AT defaults to the middle of the measured window, WARMUP +
#                    DURATION/2; FLAGS and NARI_ARGS go to every run). The kill's and the drain's entries give the
#                    listeners' pauses p50/p99/max, the pool's failovers and hand-overs, the requests cut and
#                    refused, and the drain's no_stream_cut; the scaling factor is multigpu_2gpu's successful
#                    requests per second over multigpu_1gpu's, each at its verdict. Needs .carry/nari, as nari;
#                    with WARMUP=5 DURATION=15 each run is its start-up (30 s with a carried compile cache, 2 min
#                    cold) and about 25 s of load, so the whole step fits one 10-minute call:
#                      WARMUP=5 DURATION=15 bash bench/h200.sh setup multigpu:20 savecache
#                    carrying .carry/whl .carry/voxgate_cache .carry/nari .carry/compile_cache.txz
#   profile:ARGS     bench/engine_profile.py ARGS        -> $OUT/engine_profile.json
#   textstream[:ARGS] bench/text_stream_check.py ARGS    -> $OUT/text_stream.json: text pushed word by word
#                    says exactly what the whole text says (CUDA graphs, Triton), and its first-audio times
#   resumecheck[:ARGS] bench/resume_check.py ARGS      -> $OUT/resume_check.json: a stream cut at frame k and
#                    resumed from its codes in another batch company goes on after exactly the delivered frames,
#                    without a click at the join, and how soon its first audio comes
#   resumecost[:ARGS] bench/resume_cost.py ARGS      -> $OUT/resume_cost.json: a failover's resume of N streams on
#                    the survivor, beside B speaking ones, split into admission, the resume call (profiled) and
#                    the first chunk after it, e.g. resumecost:"--streams 1,8,16 --beside 0,8"
#   tune             bench/kernel_tune.py                -> $OUT/kernel_tune.json
#   codecprofile[:ARGS] bench/codec_profile.py ARGS     -> $OUT/codec_profile.json: a codec call's top kernels,
#                    and its captured cost per batch x frames in each of --variants (bench/codec_profile.py's
#                    VARIANTS: fp32, bf16, the fused convolutions, the channels-last ones, with and without
#                    cuDNN's benchmark mode), e.g. codecprofile:"--variants bf16_fused,bf16_fused_nlc"
#   use:TYPE         build (once) the random 1.7B checkpoint of TYPE (custom_voice, base, voice_design) in
#                    /tmp/ckpt-TYPE and point the later steps at it (setup's /tmp/ckpt is custom_voice), e.g.
#                      LOAD_ARGS="--worker --clone icl" bash bench/h200.sh setup use:base load:1,10,20
#   aligner          build (once) the random Qwen3-ForcedAligner-0.6B in /tmp/aligner, for LOAD_ARGS such as
#                    "--worker --timestamps async -o aligner=/tmp/aligner"
#   alignercost[:ARGS] bench/aligner_cost.py ARGS on the random aligner in /tmp/aligner (built if missing)
#                    -> $OUT/aligner_cost.json: ms and ops per sentence at batch 1/4/16, e.g.
#                      bash bench/h200.sh alignercost:"--contend-ms 2"
#   cloneprefill     bench/clone_prefill_check.py (after use:base) -> $OUT/clone_prefill.json: cloned voices'
#                    captured prefill against the uncaptured one, and where its time goes by part
#   savecache        the Inductor/Triton caches          -> $OUT/compile_cache.txz (if under 15 MiB)
#
# Only 8 files come back from $OUT, so after each step everything there except h200.log, the *.json
# reports and the *.tgz archives (the .md tables, gateway.log, partial results) is moved into
# $OUT/extras.tgz. DRY_RUN=1 prints the commands instead of running them.

set -o pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
OUT=${OUT:?set OUT to the folder whose files come back}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/h200.log") 2>&1
TEE_PID=$!

PY=${PYTHON:-python3}
CKPT=${CKPT:-/tmp/ckpt}
SITE=/tmp/site
REF=/tmp/ref
EXTRAS=/tmp/h200-extras
STARTED=$SECONDS

export VOXGATE_CACHE=$REPO/.carry/voxgate_cache PYTHONUNBUFFERED=1
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
# A cache brought back from an earlier call saves the compile time: carried packed (.carry/compile_cache.txz,
# as savecache wrote it; unpacked it is too large to travel) and unpacked here, or already unpacked.
COMPILE_CACHE=/tmp/compile_cache
if [[ -d $REPO/.carry/compile_cache ]]; then
    COMPILE_CACHE=$REPO/.carry/compile_cache
elif [[ -f $REPO/.carry/compile_cache.txz && ! -d $COMPILE_CACHE ]]; then
    mkdir -p "$COMPILE_CACHE" && tar -C "$COMPILE_CACHE" -xJf "$REPO/.carry/compile_cache.txz"
fi
export TORCHINDUCTOR_CACHE_DIR=$COMPILE_CACHE/inductor TRITON_CACHE_DIR=$COMPILE_CACHE/triton
mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"

run() {
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

install_wheels() {  # install_wheels FOLDER TARGET
    local wheels=("$1"/*.whl)
    [[ -e ${wheels[0]} || -n ${DRY_RUN:-} ]] || { echo "no wheels in $1"; return 1; }
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "${wheels[@]}"
}

step_setup() {
    install_wheels "$REPO/.carry/whl" "$SITE" || return 1
    # The image has no PyAV (35 MB as a wheel). The gateway imports it only for compressed formats and
    # reference-audio decoding, so it serves pcm and wav (load, nari) without it: it travels in .carry/optwhl
    # only for calls whose steps need those (load with --clone), which leaves room for the compile cache.
    if ! "$PY" -c "import av" 2>/dev/null; then
        if compgen -G "$REPO/.carry/optwhl/*.whl" >/dev/null; then
            echo "the image has no PyAV: installing .carry/optwhl"
            install_wheels "$REPO/.carry/optwhl" "$SITE" || return 1
        else
            echo "no PyAV here and none carried (.carry/optwhl): the gateway serves pcm/wav only (load, nari);" \
                "--clone and compressed formats need it"
        fi
    fi
    run nvidia-smi -L
    run "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || return 1
    run "$PY" -c "import gateway.app, tts_backend.qwen3_backend, uvicorn, websockets; print('gateway imports ok')" || return 1
    if [[ -f $CKPT/config.json ]]; then
        echo "checkpoint $CKPT already there"
    else
        run "$PY" bench/make_checkpoint.py --size 1.7b --out "$CKPT" --device cuda || return 1
    fi
}

STEP_RUNS=0
step_step() {  # step_step "ARGS" (e.g. "--kernels inductor")
    local args=() suffix=""
    read -ra args <<<"$1"
    STEP_RUNS=$((STEP_RUNS + 1))
    ((STEP_RUNS > 1)) && suffix=_$STEP_RUNS
    run "$PY" bench/engine_step.py "${args[@]}" --model "$CKPT" --output "$OUT/engine_step$suffix.json"
}

step_use() {  # step_use TYPE
    local type=${1:-custom_voice} folder
    if [[ $type == custom_voice ]]; then folder=/tmp/ckpt; else folder=/tmp/ckpt-$type; fi
    if [[ -f $folder/config.json ]]; then
        echo "checkpoint $folder already there"
    else
        run "$PY" bench/make_checkpoint.py --size 1.7b --model-type "$type" --out "$folder" --device cuda || return 1
    fi
    CKPT=$folder
}

step_aligner() {
    if [[ -f /tmp/aligner/config.json ]]; then
        echo "aligner /tmp/aligner already there"
    else
        run "$PY" bench/make_checkpoint.py --aligner --size 0.6b --out /tmp/aligner || return 1
    fi
}

ALIGNERCOST_RUNS=0
step_alignercost() {  # step_alignercost "ARGS" (e.g. "--contend-ms 2 --batches 1,4,16")
    local args=() suffix=""
    read -ra args <<<"$1"
    step_aligner || return 1
    ALIGNERCOST_RUNS=$((ALIGNERCOST_RUNS + 1))
    ((ALIGNERCOST_RUNS > 1)) && suffix=_$ALIGNERCOST_RUNS
    run "$PY" bench/aligner_cost.py --model /tmp/aligner --device cuda "${args[@]}" --output "$OUT/aligner_cost$suffix.json"
}

step_reference() {
    # qwen-tts pins transformers 4.57.3 (tokenizers <= 0.23.0, huggingface_hub < 1.0); /tmp/ref comes first
    # on the path so these shadow the image's transformers 5, and /tmp/site (the gateway's wheels) stays off it.
    install_wheels "$REPO/.carry/refwhl" "$REF" || return 1
    local path=$REF:$REPO
    # qwen_tts imports torchaudio.compliance.kaldi for its 25 Hz tokenizer only; the 12 Hz model never calls
    # it, so where the image's torchaudio lacks it a stub package stands in (as tests/reference_env.py does).
    if [[ -z ${DRY_RUN:-} ]] && ! PYTHONPATH=$path "$PY" -c "import torchaudio.compliance.kaldi" 2>/dev/null; then
        echo "torchaudio.compliance.kaldi not importable: using a stub torchaudio in $REF"
        mkdir -p "$REF/torchaudio/compliance"
        touch "$REF/torchaudio/__init__.py" "$REF/torchaudio/compliance/__init__.py" "$REF/torchaudio/compliance/kaldi.py"
    fi
    run env PYTHONPATH="$path" "$PY" -c "import transformers, tokenizers, huggingface_hub, qwen_tts; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'huggingface_hub', huggingface_hub.__version__)" || return 1
    run env PYTHONPATH="$path" PYTHONWARNINGS=ignore "$PY" bench/engine_reference.py --model "$CKPT" --requests 10 --output "$OUT/reference.json"
}

NARI_SITE=/tmp/nari-site
NARI_RUNS=0
step_nari() {  # step_nari "RATES [FLAGS]"
    local rates=${1%% *} flags="" suffix=""
    [[ $1 == *" "* ]] && flags=${1#* }
    [[ -n $rates ]] || { echo "nari needs rates, e.g. nari:1,10,20,60,80,100"; return 1; }
    nari_site || return 1
    NARI_RUNS=$((NARI_RUNS + 1))
    ((NARI_RUNS > 1)) && suffix=_$NARI_RUNS
    local extra=()
    [[ -n ${SEED:-} ]] && extra+=(--seed "$SEED")
    # NARI_ARGS is split on whitespace on purpose: extra flags such as "-o max_batch=64 --arrival constant".
    # shellcheck disable=SC2206
    [[ -n ${NARI_ARGS:-} ]] && extra+=($NARI_ARGS)
    # shellcheck disable=SC2206
    [[ -n $flags ]] && extra+=($flags)
    # The harness runs on its own path (its source, its wheels, then the gateway's for pydantic and click),
    # under the image's python3 (numpy), as one harness command per rate.
    run "$PY" bench/nari_load.py --model "$CKPT" --rates "$rates" --warmup "${WARMUP:-10}" \
        --duration "${DURATION:-30}" --harness-src "$REPO/.carry/nari/tts_bench/src" \
        --harness-site "$NARI_SITE:$SITE" --harness-python "$PY" "${extra[@]}" \
        --output "$OUT/nari_load$suffix.json" --log "$OUT/nari_gateway$suffix.log"
}

nari_site() {  # the harness's source carried, its wheels installed in NARI_SITE (once)
    if [[ -z ${DRY_RUN:-} && ! -d $REPO/.carry/nari/tts_bench/src/tts_bench ]]; then
        echo "no harness in .carry/nari (bench/carry.sh builds it)"
        return 1
    fi
    if [[ ! -d $NARI_SITE ]]; then
        install_wheels "$REPO/.carry/nari/whl" "$NARI_SITE" || return 1
    fi
}

step_multigpu() {  # step_multigpu "RATE [FLAGS]"
    local rate=${1%% *} flags="" gpus=${GPUS:-0,1} warmup=${WARMUP:-10} duration=${DURATION:-30}
    [[ $1 == *" "* ]] && flags=${1#* }
    [[ $rate =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "multigpu needs one rate, e.g. multigpu:20"; return 1; }
    [[ $gpus == *,* ]] || { echo "multigpu needs two GPUs or more in GPUS (got '$gpus')"; return 1; }
    nari_site || return 1
    local double at
    double=$(awk -v r="$rate" 'BEGIN { printf "%g", 2 * r }')
    at=${KILL_AT:-$(awk -v w="$warmup" -v d="$duration" 'BEGIN { printf "%g", w + d / 2 }')}
    local common=(--model "$CKPT" --warmup "$warmup" --duration "$duration"
                  --harness-src "$REPO/.carry/nari/tts_bench/src" --harness-site "$NARI_SITE:$SITE"
                  --harness-python "$PY")
    [[ -n ${SEED:-} ]] && common+=(--seed "$SEED")
    # shellcheck disable=SC2206
    [[ -n ${NARI_ARGS:-} ]] && common+=($NARI_ARGS)
    # shellcheck disable=SC2206
    [[ -n $flags ]] && common+=($flags)
    # Each run starts its own launcher (a killed or drained worker is not restarted); a failing run is
    # reported and the next one still runs.
    local failed=0 name gpu_arg rps extra
    for name in 1gpu 2gpu kill drain; do
        gpu_arg=$gpus rps=$double extra=()
        case $name in
            1gpu) gpu_arg=${gpus%%,*} rps=$rate ;;
            kill) extra=(--kill-worker-at "$at") ;;
            drain) extra=(--drain-worker-at "$at") ;;
        esac
        echo "--- multigpu $name: --gpus $gpu_arg at $rps RPS ${extra[*]}"
        run "$PY" bench/nari_load.py "${common[@]}" --gpus "$gpu_arg" --rates "$rps" "${extra[@]}" \
            --output "$OUT/multigpu_$name.json" --log "$OUT/multigpu_${name}_gateway.log" || failed=1
    done
    return $failed
}

LOAD_RUNS=0
step_load() {  # step_load RATES
    local rates=$1 suffix=""
    [[ -n $rates ]] || { echo "load needs rates, e.g. load:1,10,20"; return 1; }
    LOAD_RUNS=$((LOAD_RUNS + 1))
    ((LOAD_RUNS > 1)) && suffix=_$LOAD_RUNS
    local extra=()
    [[ -n ${SEED:-} ]] && extra+=(--seed "$SEED")
    # SEEDS=0,1,2: every rate under each seed, reported as bench/README.md says (median of per-seed p95).
    local seed
    for seed in ${SEEDS//,/ }; do extra+=(--seed "$seed"); done
    # LOAD_ARGS is split on whitespace on purpose: it holds extra flags such as "-o max_batch=64".
    # shellcheck disable=SC2206
    [[ -n ${LOAD_ARGS:-} ]] && extra+=($LOAD_ARGS)
    # VARIANTS="LABEL FLAGS;LABEL FLAGS": engine_load.py --variant runs on the same server, split on ';' only.
    local variant
    if [[ -n ${VARIANTS:-} ]]; then
        IFS=';' read -ra variants <<<"$VARIANTS"
        for variant in "${variants[@]}"; do extra+=(--variant "$variant"); done
    fi
    run "$PY" bench/engine_load.py --model "$CKPT" --rates "$rates" --warmup "${WARMUP:-10}" \
        --duration "${DURATION:-30}" "${extra[@]}" \
        --output "$OUT/engine_load$suffix.json" --log "$OUT/gateway$suffix.log"
}

PROFILE_RUNS=0
step_profile() {  # step_profile "ARGS" (a second profile step writes engine_profile_2.json, and so on)
    local args=() suffix=""
    read -ra args <<<"$1"
    PROFILE_RUNS=$((PROFILE_RUNS + 1))
    ((PROFILE_RUNS > 1)) && suffix=_$PROFILE_RUNS
    run "$PY" bench/engine_profile.py "${args[@]}" --model "$CKPT" --output "$OUT/engine_profile$suffix.json"
}

step_textstream() {  # step_textstream "ARGS" (e.g. "--others 8 --words-per-s 100")
    local args=()
    read -ra args <<<"$1"
    run "$PY" bench/text_stream_check.py "${args[@]}" --model "$CKPT" --output "$OUT/text_stream.json"
}

step_resumecheck() {  # step_resumecheck "ARGS" (e.g. "--sentences 6 --others 16")
    local args=()
    read -ra args <<<"$1"
    run "$PY" bench/resume_check.py "${args[@]}" --model "$CKPT" --output "$OUT/resume_check.json"
}

step_resumecost() {  # step_resumecost "ARGS" (e.g. "--streams 8 --beside 8")
    local args=()
    read -ra args <<<"$1"
    run "$PY" bench/resume_cost.py "${args[@]}" --model "$CKPT" --output "$OUT/resume_cost.json"
}

step_savecache() {
    local archive=$OUT/compile_cache.txz limit=$((15 * 1024 * 1024)) size
    # What the cache holds, by kind (issue 22: it grew to 164 MB, too large to carry between machines).
    run du -sh "$COMPILE_CACHE"/inductor/* "$COMPILE_CACHE"/triton 2>/dev/null
    run find "$COMPILE_CACHE/triton" -type f -printf '%s %f\n' 2>/dev/null \
        | awk '{n = split($2, p, "."); ext = p[n]; bytes[ext] += $1; files[ext]++}
               END {for (e in bytes) printf "triton cache .%s: %d files, %.1f MB\n", e, files[e], bytes[e] / 1e6}'
    # xz, not gzip: the cache is mostly text (Triton's IR and sources, Inductor's generated code), and gzip
    # packed the H100's cold cache to 15.3 MiB, over what comes back.
    run tar -C "$COMPILE_CACHE" -cf "$archive" -I 'xz -T0 -6' inductor triton || return 1
    [[ -n ${DRY_RUN:-} ]] && return 0
    size=$(stat -c %s "$archive")
    if ((size > limit)); then
        echo "compile cache is $((size / 1024 / 1024)) MiB packed, over 15 MiB: not brought back"
        rm -f "$archive"
    else
        echo "compile cache: $archive, $((size / 1024)) KiB (unpack into .carry/compile_cache)"
    fi
}

# Keep $OUT within the 8 files that come back: side files of the steps go into one archive.
tidy_out() {
    local moved=0 f name
    mkdir -p "$EXTRAS"
    for f in "$OUT"/*; do
        [[ -f $f ]] || continue
        name=${f##*/}
        case $name in
            h200.log | extras.tgz | *.tgz | *.txz) continue ;;
            *.partial.json) ;;
            *.json) continue ;;
        esac
        mv "$f" "$EXTRAS/" && moved=1
    done
    if ((moved)); then
        tar -C "$EXTRAS" -czvf "$OUT/extras.tgz" . | tr '\n' ' ' && echo "-> extras.tgz"
    fi
}

FAILED=()
for arg in "$@"; do
    name=${arg%%:*}
    value=""
    [[ $arg == *:* ]] && value=${arg#*:}
    printf '\n===== %s | %s | %d s since start =====\n' "$arg" "$(date -u +%FT%TZ)" $((SECONDS - STARTED))
    step_started=$SECONDS
    case $name in
        setup) step_setup ;;
        step) step_step "$value" ;;
        reference) step_reference ;;
        load) step_load "$value" ;;
        nari) step_nari "$value" ;;
        multigpu) step_multigpu "$value" ;;
        profile) step_profile "$value" ;;
        textstream) step_textstream "$value" ;;
        resumecheck) step_resumecheck "$value" ;;
        resumecost) step_resumecost "$value" ;;
        use) step_use "$value" ;;
        aligner) step_aligner ;;
        alignercost) step_alignercost "$value" ;;
        tune) run "$PY" bench/kernel_tune.py --output "$OUT/kernel_tune.json" ;;
        # shellcheck disable=SC2086
        codecprofile) run "$PY" bench/codec_profile.py $value --output "$OUT/codec_profile.json" ;;
        # A Base checkpoint's: after use:base.
        cloneprefill) run "$PY" bench/clone_prefill_check.py --model "$CKPT" --output "$OUT/clone_prefill.json" ;;
        savecache) step_savecache ;;
        *) echo "unknown step '$name' (setup, step, reference, load:RATES, nari:RATES, multigpu:RATE, profile:ARGS, textstream:ARGS, resumecheck:ARGS, use:TYPE, aligner, alignercost:ARGS, cloneprefill, savecache)"; false ;;
    esac
    rc=$?
    if ((rc != 0)); then
        echo "!!!!! step $arg FAILED with exit status $rc"
        FAILED+=("$arg")
    fi
    printf '===== %s done in %d s (rc %d)\n' "$arg" $((SECONDS - step_started)) "$rc"
    [[ -n ${DRY_RUN:-} ]] || tidy_out
done

printf '\n===== all done in %d s; failed: %s\n' $((SECONDS - STARTED)) "${FAILED[*]:-none}"
# Let tee write the last lines before the call returns.
exec >&- 2>&-
wait "$TEE_PID"
((${#FAILED[@]} == 0))
