#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp that llama-cpp-python vendors, so the
# benchmark's peer runs the same llama.cpp commit as modeld's engine. Prints the binary's path
# on the last line of stdout. Safe to run again: a cached binary is reused.
#
# Offline apart from the package registry: the llama-cpp-python sdist (pip download) ships
# vendor/llama.cpp with tools/server. Built the way llama-cpp-python builds the engine
# (scikit-build-core: CMAKE_BUILD_TYPE=Release, GGML_NATIVE on = -march=native, OpenMP on,
# the system compiler), except that the libraries are linked statically into one binary. What
# this llama.cpp version needs to stay offline: LLAMA_CURL no longer exists (it is accepted with
# a deprecation warning); LLAMA_OPENSSL=OFF (no HTTPS model downloads) and
# LLAMA_USE_PREBUILT_UI=OFF / LLAMA_BUILD_UI=OFF (no web-UI download or npm build).
#
# The binary is cached under ~/.cache/modeld/llama-server/, keyed like scripts/setup.sh's
# wheelhouse by (version, CMake arguments, architecture, CPU flags): a -march=native binary
# must never run on a CPU that lacks its instructions. Override the location with
# MODELD_LLAMA_SERVER_CACHE. About 10 minutes on 2 cores. With --cached-only it builds nothing:
# it prints the cached binary's path, or nothing (exit 1) when there is none.
set -euo pipefail

PYTHON=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36
JOBS=${JOBS:-$(nproc)}
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DGGML_OPENMP=ON
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_TOOLS=ON
)
export PIP_DISABLE_PIP_VERSION_CHECK=1

cpu_flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
key=$(printf '%s\n%s\n%s\n%s\n' "$LLAMA_CPP_VERSION" "${CMAKE_FLAGS[*]}" "$(uname -m)" "$cpu_flags" | sha256sum | cut -c1-16)
dest="${MODELD_LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/llama-server}/llama-server-$LLAMA_CPP_VERSION-$key"

if [ -x "$dest/llama-server" ]; then
    [ "${1:-}" = "--cached-only" ] || echo "build_llama_server: using the cached binary in $dest" >&2
    echo "$dest/llama-server"
    exit 0
fi
[ "${1:-}" = "--cached-only" ] && exit 1

tmp="$dest.tmp.$$"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
echo "build_llama_server: downloading the llama-cpp-python $LLAMA_CPP_VERSION sdist" >&2
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_CPP_VERSION" >&2
tar -xzf "$tmp"/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
[ -f "$src/tools/server/server.cpp" ] || {
    echo "build_llama_server: the sdist has no vendor/llama.cpp/tools/server" >&2
    exit 1
}

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "build_llama_server: compiling llama-server ($JOBS jobs; about 10 minutes on 2 cores)" >&2
cmake -S "$src" -B "$tmp/build" "${generator[@]}" "${CMAKE_FLAGS[@]}" >"$tmp/cmake.log" 2>&1 || {
    tail -n 40 "$tmp/cmake.log" >&2
    exit 1
}
cmake --build "$tmp/build" --target llama-server -j "$JOBS" >"$tmp/build.log" 2>&1 || {
    tail -n 40 "$tmp/build.log" >&2
    exit 1
}

mkdir -p "$tmp/out"
cp "$tmp/build/bin/llama-server" "$tmp/out/llama-server"
{
    echo "llama-cpp-python sdist: $LLAMA_CPP_VERSION (vendor/llama.cpp)"
    echo "cmake: ${CMAKE_FLAGS[*]} ${generator[*]}"
    echo "compiler: $(${CXX:-c++} --version | head -n1)"
    echo "arch: $(uname -m)"
    "$tmp/out/llama-server" --version 2>&1 | sed 's/^/llama-server --version: /'
} >"$tmp/out/BUILD-INFO"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/out" "$dest"
echo "build_llama_server: built $dest/llama-server" >&2
echo "$dest/llama-server"
