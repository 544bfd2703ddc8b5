#!/usr/bin/env bash
# Install SGLang's model gateway, `smg`, from PyPI at a pinned version, for the fleet tests and
# benchmark (blueprints/0020-fleet.md). Prints the path of an `smg` launcher on stdout.
#
# The package goes into
#   ${MODELD_SMG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/smg}/smg-<version>
# (`pip install --target`, beside a launcher script that finds its own directory, so the install
# can be moved) and is reused as it is when that directory holds the `.installed` marker (no
# network then). An install goes into a temporary directory beside it and is renamed into place
# only after `smg launch --help` ran, so an interrupted or concurrent install never leaves a
# half-made one. The wheel holds a compiled extension for this Python's ABI: the launcher runs
# the interpreter that installed it (PYTHON, default python3; a virtualenv's base interpreter).
#
# Exit codes: 0 installed (or cached); 3 the package index is unreachable (one line on stderr
# saying why: tests skip with it); 1 anything else. Usage: install_smg.sh [--cached-only]
# (print what is cached, install nothing; exit 1 when it is missing).
set -euo pipefail

SMG_VERSION=1.13.0
PIP_TIMEOUT=${MODELD_SMG_PIP_TIMEOUT:-600}
cache="${MODELD_SMG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/smg}"
cached_only=0
case "${1:-}" in
    "") ;;
    --cached-only) cached_only=1 ;;
    *)
        echo "install_smg: unknown argument '$1' (usage: install_smg.sh [--cached-only])" >&2
        exit 2
        ;;
esac

dest="$cache/smg-$SMG_VERSION"
launcher="$dest/bin/smg"
if [ -f "$dest/.installed" ] && [ -x "$launcher" ]; then
    echo "$launcher"
    exit 0
fi
if [ "$cached_only" = 1 ]; then
    echo "install_smg: smg $SMG_VERSION is not cached in $dest" >&2
    exit 1
fi

# The interpreter the launcher runs: the real file behind PYTHON (a virtualenv's python is a
# link to its base interpreter, which outlives the virtualenv).
python=$(command -v "${PYTHON:-python3}") || {
    echo "install_smg: ${PYTHON:-python3} is not installed" >&2
    exit 1
}
python=$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')
"$python" -m pip --version >/dev/null 2>&1 || {
    echo "install_smg: $python has no pip" >&2
    exit 1
}

# pip's network failures, as it prints them.
NETWORK_ERRORS='NewConnectionError|Temporary failure in name resolution|Name or service not known|Connection refused|Network is unreachable|ConnectTimeoutError|ReadTimeoutError|Max retries exceeded|No route to host|ProxyError|SSLError'

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.smg-$SMG_VERSION.tmp.XXXXXX")
log="$tmp.log"
trap 'rm -rf "$tmp" "$log"' EXIT
chmod 755 "$tmp"
start=$SECONDS
echo "install_smg: installing smg==$SMG_VERSION into $dest" >&2
if ! PIP_DISABLE_PIP_VERSION_CHECK=1 timeout "$PIP_TIMEOUT" "$python" -m pip install --quiet \
    --no-input --retries 1 --timeout 30 --target "$tmp/lib" "smg==$SMG_VERSION" >"$log" 2>&1; then
    if grep -q -E "$NETWORK_ERRORS" "$log"; then
        line=$(grep -m1 -E "$NETWORK_ERRORS" "$log" | cut -c1-300)
        echo "install_smg: the package index is unreachable: $line" >&2
        exit 3
    fi
    tail -n 20 "$log" >&2
    echo "install_smg: pip install smg==$SMG_VERSION failed" >&2
    exit 1
fi
mkdir -p "$tmp/bin"
cat >"$tmp/bin/smg" <<EOF
#!/bin/sh
# smg $SMG_VERSION, installed by modeld's scripts/install_smg.sh.
here=\$(CDPATH= cd -- "\$(dirname -- "\$0")/.." && pwd)
PYTHONPATH="\$here/lib" exec "$python" -c 'import sys; from smg.cli import main; sys.argv[0] = "smg"; sys.exit(main())' "\$@"
EOF
chmod 755 "$tmp/bin/smg"
if ! got=$("$tmp/bin/smg" launch --help 2>&1); then
    echo "$got" | tail -n 20 >&2
    echo "install_smg: smg launch --help fails after installing smg==$SMG_VERSION" >&2
    exit 1
fi
case "$got" in
    *--routing-key-headers*) ;;
    *)
        echo "install_smg: smg launch --help does not list --routing-key-headers" >&2
        exit 1
        ;;
esac
version=$(PYTHONPATH="$tmp/lib" "$python" -c 'from importlib.metadata import version; print(version("smg"))')
if [ "$version" != "$SMG_VERSION" ]; then
    echo "install_smg: installed smg $version, expected $SMG_VERSION" >&2
    exit 1
fi
printf 'smg==%s\n%s\n' "$SMG_VERSION" "$python" >"$tmp/.installed"
# mv -T fails instead of moving into an existing directory: a concurrent install won.
if ! mv -T "$tmp" "$dest" 2>/dev/null; then
    [ -f "$dest/.installed" ] || {
        echo "install_smg: cannot move the install into $dest (a broken directory is in the way?)" >&2
        exit 1
    }
    rm -rf "$tmp"
fi
rm -f "$log"
trap - EXIT
echo "install_smg: smg $SMG_VERSION installed in $((SECONDS - start)) s" >&2
echo "$launcher"
