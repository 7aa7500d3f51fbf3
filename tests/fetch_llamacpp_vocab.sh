#!/usr/bin/env bash
# Fetch llama.cpp's vocab-only GGUFs and expected tokenizations (ggml-vocab-*.gguf + .inp/.out)
# from the llama-cpp-python sdist, for tests/model/test_llamacpp_vocab.py.
# Destination: $PERFX_LLAMACPP_VOCAB_DIR or ~/.cache/perfx/llamacpp-vocab.
set -euo pipefail
VERSION=0.3.36
DEST="${PERFX_LLAMACPP_VOCAB_DIR:-$HOME/.cache/perfx/llamacpp-vocab}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==${VERSION}" -d "$TMP"
tar -xzf "$TMP/llama_cpp_python-${VERSION}.tar.gz" -C "$TMP" --wildcards \
    "llama_cpp_python-${VERSION}/vendor/llama.cpp/models/ggml-vocab-*"
mkdir -p "$DEST"
cp "$TMP/llama_cpp_python-${VERSION}/vendor/llama.cpp/models/"ggml-vocab-* "$DEST/"
echo "llama.cpp vocab test files: $DEST ($(ls "$DEST" | wc -l) files)"
