#!/usr/bin/env bash
# Install the real coding agents that modeld's agent tests run: Claude Code and Codex CLI, from
# npm, at pinned versions. Prints one `name=path-to-binary` line per agent on stdout.
#
# Each package goes into its own npm prefix under
#   ${MODELD_AGENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/agents}/<pkg>-<version>
# and is reused as it is when that directory holds the `.installed` marker (no network then).
# An install goes into a temporary directory beside it and is renamed into place only after the
# binary ran `--version`, so an interrupted or concurrent install never leaves a half-made one.
#
# Both packages ship native binaries (x86_64/arm64, glibc/musl) as optional dependencies:
# Codex's launcher (bin/codex.js) finds its platform package at run time; Claude Code's
# postinstall (install.cjs) puts the platform binary over bin/claude.exe. If npm skipped that
# postinstall (npm 11 may, for scripts not in allow-scripts), it is run here.
#
# Exit codes: 0 installed (or cached); 3 the npm registry is unreachable (one line on stderr
# saying why: tests skip with it); 1 anything else (the version does not exist, the binary does
# not run, ...). Usage: install_agents.sh [--cached-only] (print what is cached, install nothing;
# exit 1 when something is missing).
set -euo pipefail

AGENTS=(
    "claude=@anthropic-ai/claude-code@2.1.328"
    "codex=@openai/codex@0.169.0"
)
NPM_TIMEOUT=${MODELD_AGENTS_NPM_TIMEOUT:-600}
cache="${MODELD_AGENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/modeld/agents}"
cached_only=0
case "${1:-}" in
    "") ;;
    --cached-only) cached_only=1 ;;
    *)
        echo "install_agents: unknown argument '$1' (usage: install_agents.sh [--cached-only])" >&2
        exit 2
        ;;
esac

export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false

# npm's network failures, as it prints them (error codes of node's resolver and sockets).
NETWORK_ERRORS='ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ESOCKETTIMEDOUT|ENETUNREACH|EHOSTUNREACH|network request to .* failed|request to .* failed, reason'

unreachable() { # $1 = npm's log: exit 3 with one line when it shows a network failure.
    local line
    grep -q -E "$NETWORK_ERRORS" "$1" || return 0
    line=$(grep -m1 -E 'FetchError|request to .* failed' "$1" || grep -m1 -E "$NETWORK_ERRORS" "$1")
    line=${line#npm error }
    if [ -n "$line" ]; then
        echo "install_agents: the npm registry ($(npm config get registry 2>/dev/null || echo '?')) is unreachable: ${line#FetchError: }" >&2
        exit 3
    fi
}

command -v npm >/dev/null || {
    echo "install_agents: npm is not installed (Node.js 20 or newer with npm is needed)" >&2
    exit 1
}

mkdir -p "$cache"
for entry in "${AGENTS[@]}"; do
    name=${entry%%=*}
    spec=${entry#*=}
    pkg=${spec%@*}
    version=${spec##*@}
    dest="$cache/${pkg##*/}-$version"
    bin="$dest/bin/$name"
    if [ -f "$dest/.installed" ] && [ -x "$bin" ]; then
        echo "$name=$bin"
        continue
    fi
    if [ "$cached_only" = 1 ]; then
        echo "install_agents: $spec is not cached in $dest" >&2
        exit 1
    fi

    tmp=$(mktemp -d "$cache/.${pkg##*/}-$version.tmp.XXXXXX")
    chmod 755 "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    log="$tmp.log"
    trap 'rm -rf "$tmp" "$log"' EXIT
    start=$SECONDS
    echo "install_agents: installing $spec into $dest" >&2
    if ! timeout "$NPM_TIMEOUT" npm install --global --prefix "$tmp" --no-audit --no-fund \
        --loglevel=warn --fetch-retries=1 --fetch-timeout=30000 "$spec" >"$log" 2>&1; then
        unreachable "$log"
        grep -E '^npm (error|ERR)' "$log" | head -n 20 >&2 || tail -n 20 "$log" >&2
        echo "install_agents: npm install $spec failed" >&2
        exit 1
    fi
    pkgdir="$tmp/lib/node_modules/$pkg"
    if ! "$tmp/bin/$name" --version >/dev/null 2>&1 && [ -f "$pkgdir/install.cjs" ]; then
        # npm did not run the postinstall that puts the native binary in place.
        (cd "$pkgdir" && node install.cjs) >>"$log" 2>&1 || true
    fi
    if ! got=$("$tmp/bin/$name" --version 2>&1); then
        tail -n 20 "$log" >&2
        echo "install_agents: $name --version fails after installing $spec: $got" >&2
        exit 1
    fi
    case "$got" in
        *"$version"*) ;;
        *)
            echo "install_agents: $name --version says '$got', expected $version" >&2
            exit 1
            ;;
    esac
    printf '%s\n%s\n' "$spec" "$got" >"$tmp/.installed"
    # mv -T fails instead of moving into an existing directory: a concurrent install won.
    if ! mv -T "$tmp" "$dest" 2>/dev/null; then
        [ -f "$dest/.installed" ] || {
            echo "install_agents: cannot move the install into $dest (a broken directory is in the way?)" >&2
            exit 1
        }
        rm -rf "$tmp"
    fi
    rm -f "$log"
    trap - EXIT
    echo "install_agents: $spec installed in $((SECONDS - start)) s" >&2
    echo "$name=$bin"
done
