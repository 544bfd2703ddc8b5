#!/usr/bin/env bash
# A fleet on one machine, for a trial of the README's deployment guide ("Many boxes behind the
# SGLang gateway"): three `modeld serve --http` daemons on 127.0.0.1:8081-8083 that share one
# snapshot store, and SGLang's model gateway (smg) on 127.0.0.1:30000 in front of them, with the
# guide's flags. Ctrl-C (or SIGTERM) drains the daemons and stops everything.
#
# One flag differs from the guide: --persist-min-tokens 64 writes a prefix through to the store
# from 64 computed tokens instead of 512, so a trial's short hand-typed turns move warm too (an
# agent's prompts are thousands of tokens).
#
# Usage: deploy/fleet-trial.sh [DIR]            (default ./fleet-trial: data, store, logs)
# Environment:
#   MODELD   the modeld command (default: modeld, else .venv/bin/modeld of this checkout)
#   SMG      the smg command (default: smg on PATH, else scripts/install_smg.sh installs it)
#   MODEL    NAME=PATH of the one model every daemon serves (default: the generated
#            modeld-reply test model, which answers briefly and ends its turns)
#   BACKEND  llama (default), openvino or memory
#   API_KEY  the key daemons and gateway require (default: trial-key)
#   PORT     the gateway's port (default 30000); the daemons take PORT-29919.. (8081-8083)
set -euo pipefail

here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
dir=${1:-./fleet-trial}
backend=${BACKEND:-llama}
key=${API_KEY:-trial-key}
port=${PORT:-30000}
modeld=${MODELD:-$(command -v modeld || echo "$here/.venv/bin/modeld")}
[ -x "$modeld" ] || { echo "fleet-trial: no modeld command (make setup, or MODELD=...)" >&2; exit 1; }
smg=${SMG:-$(command -v smg || "$here/scripts/install_smg.sh")}
python=$(dirname -- "$modeld")/python
[ -x "$python" ] || python=python3
if [ -z "${MODEL:-}" ]; then
    if [ "$backend" = memory ]; then
        MODEL=modeld-tiny=modeld-tiny
    else
        MODEL=modeld-reply=$("$python" -m modeld.testmodels reply)
    fi
fi
name=${MODEL%%=*}

mkdir -p "$dir/store"
dir=$(CDPATH= cd -- "$dir" && pwd)
pids=()
stop() {
    trap - EXIT INT TERM
    echo "fleet-trial: stopping (the daemons drain)" >&2
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait
}
trap stop EXIT INT TERM

urls=()
for i in 1 2 3; do
    http_port=$((port - 30000 + 8080 + i))
    mkdir -p "$dir/box$i"
    "$modeld" --data-dir "$dir/box$i" serve --backend "$backend" \
        --listen "unix:$dir/box$i/grpc.sock" --http "127.0.0.1:$http_port" --api-key "$key" \
        --model "$MODEL" --shared-store "$dir/store" --drain-timeout 60s \
        --persist-min-tokens 64 \
        >"$dir/box$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$http_port")
done
for url in "${urls[@]}"; do
    for _ in $(seq 1 600); do
        curl -fsS "$url/health" >/dev/null 2>&1 && break
        sleep 0.2
    done
    curl -fsS "$url/health" >/dev/null || { echo "fleet-trial: $url did not start (see $dir/box*.log)" >&2; exit 1; }
done

"$smg" launch --host 127.0.0.1 --port "$port" \
    --worker-urls "${urls[@]}" --api-key "$key" \
    --policy least_load --sticky-sessions --routing-key-headers X-SMG-Routing-Key \
    --health-check-interval-secs 2 --health-failure-threshold 1 --load-monitor-interval 2 \
    --prometheus-host 127.0.0.1 --prometheus-port $((port - 1000)) --shutdown-grace-period-secs 5 \
    >"$dir/smg.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
    healthy=$(curl -fsS -H "Authorization: Bearer $key" "http://127.0.0.1:$port/workers" 2>/dev/null | grep -o '"is_healthy":true' | wc -l || true)
    [ "${healthy:-0}" -ge 3 ] && break
    sleep 0.2
done
echo "fleet-trial: gateway http://127.0.0.1:$port/v1 (model $name, key $key) in front of ${urls[*]}"
echo "fleet-trial: daemon pids ${pids[*]:0:3} (kill one, or: $modeld --data-dir $dir/box1 drain)"
echo "fleet-trial: logs and the shared store in $dir; Ctrl-C stops everything"
wait "${pids[3]}"
