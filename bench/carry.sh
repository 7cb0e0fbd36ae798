#!/usr/bin/env bash
# Build .carry/ for bench/h200.sh on a machine with PyPI (the device machine has none), from the repository root:
#
#   bash bench/carry.sh            # then: run(..., carry=[".carry/whl", ".carry/voxgate_cache", ...])
#
#   .carry/whl            the gateway's dependencies as Python 3.12 manylinux wheels (the device image's python3),
#                         less what the image has (numpy) or the bench never uses (watchfiles): about 5 MB
#   .carry/optwhl         PyAV (35 MB), which the image lacks; the gateway imports it only where it is used, so
#                         only steps that need compressed formats or reference-audio decoding carry it (load with
#                         --clone, say); load and nari over pcm/wav run without it
#   .carry/voxgate_cache  the Qwen tokenizer files bench/make_checkpoint.py writes into random checkpoints (7 MB)
#   .carry/nari           the peer's harness for bench/h200.sh's nari step: its source at the pinned commit
#                         (tts_bench/, from the cache tests/nari_bench_env.py keeps: no GitHub needed once it is
#                         there) and its dependencies' wheels (whl/) as its uv.lock pins them, less what the image
#                         (numpy) or .carry/whl (pydantic, click, ...) has: about 7.5 MB
#
#   .carry/spare          wheels no bench step imports (redis: only the Redis store and discovery; pyyaml), kept
#                         out of what a call carries
#
# A call carries at most 64 MiB with the tracked files (9.8 MB on 2026-12-06, counted on disk). Without
# .carry/optwhl (load and nari over pcm/wav, profile, step) whl + voxgate_cache + nari + an earlier call's
# compile_cache.txz copied to .carry/compile_cache.txz (5.3 MiB) come to about 35 MB with the tracked files,
# room enough for uvloop (4.5 MB, in .carry/whl: the loop the earlier figures ran on). With .carry/optwhl
# (--clone) those fit only without .carry/nari and without uvloop (`mv .carry/whl/uvloop-* .carry/spare/`); the
# gateway and worker then run on asyncio's loop (say so beside the figures).
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
mv .carry/whl/redis-* .carry/whl/pyyaml-* .carry/spare/
# The harness: its source (digest-checked against the pinned commit by tests/nari_bench_env.py) laid out as in
# its repository (uv.lock beside src/, where its run.json looks for it), and the wheels .carry/whl lacks.
nari_src=$("$PY" -c "from tests.nari_bench_env import source_dir; print(source_dir())")
nari_commit=$("$PY" -c "from tests.nari_bench_env import COMMIT; print(COMMIT)")
rm -rf .carry/nari && mkdir -p .carry/nari/tts_bench .carry/nari/whl
cp -r "$nari_src/tts_bench/src" "$nari_src/tts_bench/pyproject.toml" "$nari_src/tts_bench/uv.lock" \
    "$nari_src/tts_bench/README.md" .carry/nari/tts_bench/
find .carry/nari -name __pycache__ -prune -exec rm -rf {} +
echo "$nari_commit" >.carry/nari/tts_bench/COMMIT
nari_requirements=$("$PY" -c "from tests.nari_bench_env import REQUIREMENTS; print(' '.join(r for r in REQUIREMENTS if not r.startswith('numpy')))")
# shellcheck disable=SC2086
PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --isolated --index-url https://pypi.org/simple --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .carry/nari/whl $nari_requirements
for wheel in .carry/nari/whl/*.whl; do
    dist=${wheel##*/}
    dist=${dist%%-*}
    if [[ $dist == numpy ]] || compgen -G ".carry/whl/$dist-*.whl" >/dev/null; then rm -f "$wheel"; fi
done
VOXGATE_CACHE=$PWD/.carry/voxgate_cache "$PY" -c \
    "from tts_backend.qwen3.testing.checkpoint import qwen_tokenizer_files as f; print(f())"
du -sh .carry/*
