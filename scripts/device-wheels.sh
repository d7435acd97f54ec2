#!/usr/bin/env bash
# The wheels scripts/device-check.sh installs on a GPU machine that has no
# network: what kvstore, its tests and the reference engine import that such
# a machine lacks (it has torch, numpy, aiohttp, xxhash, prometheus-client,
# rich, httpx, pyyaml, anyio, h11, pytest and pytest-timeout). Pinned to the
# versions of .venv, downloaded for one Python version (the GPU machine's is
# 3.12) into ./.whl (git-ignored through .git/info/exclude: carry it).
#
#   scripts/device-wheels.sh [PYTHON_VERSION [DEST]]      # default: 3.12 .whl
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
dest=${2:-.whl}

# kvstore's own dependencies that the machine lacks (pyproject.toml), pytest
# with its plug-ins at known versions (the machine's own may be older than
# pytest-asyncio needs), and what the reference engine imports
# (transformers, safetensors and what importing the model imports; hf-xet
# is only for downloads, so it stays home: 4 MiB).
pins=(
    rfc8785==0.1.4
    zstandard==0.25.0
    cryptography==50.0.2
    cffi==2.1.1
    pycparser==3.12
    lmdb==3.0.0
    starlette==1.10.0
    uvicorn==0.54.0
    httptools==0.9.0
    click==8.5.1
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
    pytest-asyncio==1.5.0
    pytest-timeout==2.4.0
    packaging==26.4
    transformers==5.25.0
    safetensors==0.8.0
    tokenizers==0.23.3
    huggingface_hub==2.4.0
    regex==2026.11.19
    tqdm==4.70.1
    httpx2==2.16.2
    httpcore2==2.16.2
    truststore==0.10.5
)

python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
du -sh "$dest"
