#!/usr/bin/env bash
# Create the project's virtual environment and install modeld with every backend and the
# development tools. Safe to run again: it only does what is missing.
#
# llama-cpp-python is published as source only, so every install compiles llama.cpp (about
# 3.5 minutes on 2 cores). pip's own wheel cache ignores CMAKE_ARGS, so we keep an explicit
# wheelhouse keyed by (version, CMAKE_ARGS, architecture, CPU flags): llama.cpp builds with
# -march=native by default, and a wheel built here must never be installed on a CPU that lacks
# these instructions (it would die with SIGILL). Override the location with MODELD_WHEELHOUSE.
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
LLAMA_CPP_VERSION=0.3.36
CMAKE_ARGS=${CMAKE_ARGS:--DLLAVA_BUILD=OFF}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --quiet)
"${PIP[@]}" install --upgrade pip wheel setuptools

if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_VERSION')" 2>/dev/null; then
    cpu_flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
    key=$(printf '%s\n%s\n%s\n%s\n' "$LLAMA_CPP_VERSION" "$CMAKE_ARGS" "$(uname -m)" "$cpu_flags" | sha256sum | cut -c1-16)
    wheelhouse="${MODELD_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/wheels}/llama-cpp-python-$key"
    wheel=$(ls "$wheelhouse"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
        echo "setup: compiling llama-cpp-python $LLAMA_CPP_VERSION (CMAKE_ARGS=$CMAKE_ARGS); this takes a few minutes"
        tmp="$wheelhouse.tmp.$$"
        mkdir -p "$tmp"
        CMAKE_ARGS="$CMAKE_ARGS" "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
        mkdir -p "$wheelhouse"
        mv "$tmp"/llama_cpp_python-*.whl "$wheelhouse"/
        rm -rf "$tmp"
        wheel=$(ls "$wheelhouse"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl | head -n1)
    else
        echo "setup: using the cached llama-cpp-python wheel in $wheelhouse"
    fi
    "${PIP[@]}" install "$wheel"
fi

echo "setup: installing modeld and its dependencies"
"${PIP[@]}" install -e ".[dev,llama,openvino,bench,http]"
echo "setup: done ($VENV)"
