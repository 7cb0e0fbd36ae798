#!/usr/bin/env bash
# Build .carry/ for bench/h200.sh on a machine with PyPI (the device machine has none), from the repository root:
#
#   bash bench/carry.sh            # then: run(..., carry=[".carry/whl", ".carry/optwhl", ".carry/voxgate_cache"])
#
#   .carry/whl            the gateway's dependencies as Python 3.12 manylinux wheels (the device image's python3),
#                         less what the image has (numpy) or the bench never uses (watchfiles): about 11 MB
#   .carry/optwhl         PyAV (35 MB), which the image lacks and only steps that start the gateway (load) need
#   .carry/voxgate_cache  the Qwen tokenizer files bench/make_checkpoint.py writes into random checkpoints (7 MB)
#
#   .carry/spare          wheels no bench step imports (redis: only the Redis store and discovery; pyyaml) and
#                         uvloop (4.5 MB; uvicorn then runs the asyncio loop), kept out of what a call carries
#
# A call carries at most 64 MiB with the tracked files (9.6 MB on 2026-12-06, counted on disk): with an earlier
# call's compile_cache.txz copied to .carry/compile_cache.txz (5.3 MiB) the four paths fit only without uvloop;
# a load step then runs the gateway and worker on asyncio's loop (say so beside its figures). Engine-only calls
# (profile, step) leave .carry/optwhl out and may carry uvloop back in .carry/whl.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # with the repository's dependencies (README's command 2) for the tokenizer files
mkdir -p .carry/whl .carry/optwhl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --isolated --index-url https://pypi.org/simple --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .carry/whl \
    'fastapi>=0.115' 'uvicorn[standard]>=0.30' 'websockets>=13' 'pydantic>=2.7' 'pydantic-settings>=2.3' pysbd==0.3.4 \
    'soxr>=0.5' 'av>=14' 'prometheus-client>=0.20' 'redis>=5.0' 'python-multipart>=0.0.18' 'h11>=0.14'
rm -f .carry/whl/numpy-* .carry/whl/watchfiles-*
mv .carry/whl/av-* .carry/optwhl/
mkdir -p .carry/spare
mv .carry/whl/redis-* .carry/whl/pyyaml-* .carry/whl/uvloop-* .carry/spare/
VOXGATE_CACHE=$PWD/.carry/voxgate_cache "$PY" -c \
    "from tts_backend.qwen3.testing.checkpoint import qwen_tokenizer_files as f; print(f())"
du -sh .carry/*
