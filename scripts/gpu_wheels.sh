#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels scripts/gpu_check.sh installs on a GPU machine that
# has PyTorch but no package registry (docs/gpu.md): Colossal-AI 0.5.0's pinned transformers
# stack and the imports Colossal-AI makes at start-up, for CPython 3.12 on x86-64 Linux.
# bitsandbytes is kept to its CUDA 13.0 and CPU libraries (the GPU image's torch is cu130):
# the full wheel's other builds would put the tree over the machine's 64 MiB transfer limit.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any)
flags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in "${platforms[@]}"; do flags+=(--platform "$p"); done
for pkg in transformers==4.51.3 tokenizers==0.21.4 huggingface_hub==0.36.2 peft==0.13.2 \
           pydantic==2.14.3 pydantic_core==2.50.4 annotated_types==0.8.0 \
           typing_inspection==0.4.5 galore_torch==1.0 bitsandbytes==0.50.2; do
    python3 -m pip download -q "${flags[@]}" "$pkg"
done
work=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: colossalai==0.5.0 -d "$work"
tar xzf "$work"/colossalai-0.5.0.tar.gz -C "$work"
python3 -m venv "$work/venv" && "$work/venv/bin/pip" install -q wheel setuptools
(cd "$work/colossalai-0.5.0" && "$work/venv/bin/python" setup.py -q bdist_wheel)
cp "$work"/colossalai-0.5.0/dist/colossalai-0.5.0-py3-none-any.whl .whl/
mkdir "$work/bnb" && (cd "$work/bnb" && unzip -q "$OLDPWD"/.whl/bitsandbytes-0.50.2-*.whl \
    && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' \
       -delete && rm "$OLDPWD"/.whl/bitsandbytes-0.50.2-*.whl \
    && zip -q -r "$OLDPWD"/.whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl .)
rm -rf "$work"
du -sh .whl
