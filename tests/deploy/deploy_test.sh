#!/usr/bin/env bash
# The deploy test (part of the test command): builds the Docker image and
# runs it, brings up the compose stack with Prometheus and the replicated
# stack behind nginx, and lints/validates every deploy artifact.
#   - installs what is missing (docker.io, docker-compose, debootstrap,
#     yamllint, nodejs/npm) with apt-get;
#   - uses a running Docker engine, or starts its own dockerd (state in
#     $MHA_DOCKER_DIR, default /var/tmp/mha-docker, which keeps the layer cache)
#     and stops it at the end;
#   - makes a local debian:bookworm base with debootstrap when absent (no
#     registry is needed);
#   - removes the containers, networks and volumes it made, and stops only
#     the processes it started. Images stay as build cache.
# Needs root (dockerd) and a built ./build/mha_client (the test command
# builds it first).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
here="$root/tests/deploy"
client="$root/build/mha_client"
state="${MHA_DOCKER_DIR:-/var/tmp/mha-docker}"
project="mhadeploy$$"
mkdir -p "$state/data" "$state/exec"
export PATH="/usr/bin:$PATH"  # Debian's docker client (with BuildKit), not another one first on PATH
export DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1

step() { echo "== deploy: $* (at ${SECONDS} s)"; }
fail() { echo "FAIL deploy: $*" >&2; exit 1; }
quiet() {  # quiet CMD...: runs CMD, shows its output only when it fails
  "$@" >"$state/last.log" 2>&1 || { tail -40 "$state/last.log"; fail "$*"; }
}
[ -x "$client" ] || fail "$client missing: build first (deploy/debian/build.sh)"

# --- packages -------------------------------------------------------------
missing=()
for p in docker.io docker-compose debootstrap yamllint curl; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
done
command -v npm >/dev/null || missing+=(nodejs npm)
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Docker engine --------------------------------------------------------
started_dockerd=""
seed="$root/build/ccache-seed"  # the image's ccache seed (docker build below)
rm -rf "$seed"
cleanup() {
  set +e
  rm -rf "$seed"
  docker rm -f "$project-single" "$project-kserve" >/dev/null 2>&1
  for f in docker-compose.yml docker-compose.replicas.yml; do
    (cd "$root/deploy/compose" && docker-compose -p "$project" -f "$f" down -v --remove-orphans >/dev/null 2>&1)
  done
  if [ -n "$started_dockerd" ]; then
    kill "$started_dockerd" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 1; done
  fi
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
  export DOCKER_HOST="unix://$state/docker.sock"
  if ! docker info >/dev/null 2>&1; then
    step "starting dockerd (data in $state)"
    dockerd --data-root "$state/data" --exec-root "$state/exec" -H "$DOCKER_HOST" \
      --pidfile "$state/dockerd.pid" >"$state/dockerd.log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$state/dockerd.log"; fail "dockerd did not start"; }
  fi
fi

# --- local base image -----------------------------------------------------
if ! docker image inspect debian:bookworm >/dev/null 2>&1; then
  step "making debian:bookworm with debootstrap"
  rootfs="$(mktemp -d)"
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs/etc/apt/sources.list"
  cp "$here/debian.sources" "$rootfs/etc/apt/sources.list.d/debian.sources"
  tar -C "$rootfs" -c . | docker import - debian:bookworm >/dev/null
  rm -rf "$rootfs"
fi

# --- lint and validate the artifacts --------------------------------------
step "dockerfilelint, yamllint, kubernetes schemas"
node_dir="$state/node"
mkdir -p "$node_dir"
cp "$here/package.json" "$here/package-lock.json" "$node_dir/"
(cd "$node_dir" && quiet npm ci --no-audit --no-fund)
"$node_dir/node_modules/.bin/dockerfilelint" "$root/Dockerfile" "$root"/deploy/compose/*/Dockerfile
yamllint --strict -c "$root/deploy/.yamllint" "$root/deploy"
MHA_NODE_MODULES="$node_dir/node_modules" node "$here/validate_k8s.mjs" "$root/deploy/k8s"
/usr/bin/python3 "$here/validate_kserve.py" "$root/deploy/kserve"

# --- the image ------------------------------------------------------------
step "docker build"
# The build stage compiles through ccache, seeded from the host build's
# (build/ccache) when there is one: the same compiler, source path and flags,
# so most files come from it (Dockerfile). Its counts are checked, so that a
# flag or path that drifts apart shows here and not only in the time. The
# seed stays, unchanged, until the end (cleanup), and compose's builds get the
# same MHA_SOURCE_DIR: they must find every layer of this build in the cache.
[ -d "$root/build/ccache" ] && cp -al "$root/build/ccache" "$seed"
export MHA_SOURCE_DIR="$root"
began=$SECONDS
quiet docker build --progress=plain --build-arg MHA_SOURCE_DIR="$root" -t mha-serve:latest "$root"
read -r hits misses < <(sed -n 's/.*ccache hits=\([0-9]*\) misses=\([0-9]*\).*/\1 \2/p' "$state/last.log" | tail -1) || true  # nothing: the stage was cached
if [ -z "${hits:-}" ]; then
  echo "docker build: $((SECONDS - began)) s, its build stage in Docker's layer cache"
else
  echo "docker build: $((SECONDS - began)) s; the build stage's ccache: $hits hits, $misses misses"
  # Two may differ: mha_server's main.cc by design (its default model path),
  # and the HTTP front end when the image's gnutls headers are a newer
  # Debian update than the host's.
  [ ! -d "$root/build/ccache" ] || [ "$misses" -le 2 ] ||
    fail "the build stage compiled $misses files that the host build's ccache should have held"
fi
docker run --rm --entrypoint sh mha-serve:latest -c \
  'test "$(id -u)" = 10001 && ! command -v g++ && ! command -v cc && ! ls /var/lib/apt/lists/*_Packages' \
  >/dev/null 2>&1 || fail "image runs as root, has a compiler or keeps apt lists"
echo "image size: $(docker image inspect -f '{{.Size}}' mha-serve:latest | awk '{printf "%.0f MB", $1/1e6}')"
image_id="$(docker image inspect -f '{{.Id}}' mha-serve:latest)"
# compose's `up --build` must be served from this build's layers, not compile
# again (a build argument or context file that differs would).
same_image() {
  [ "$(docker image inspect -f '{{.Id}}' mha-serve:latest)" = "$image_id" ] ||
    fail "compose built another mha-serve image than docker build did (compiled again)"
}

step "docker run (read-only root, non-root) + mha_client + /metrics"
docker run -d --name "$project-single" --read-only -p 127.0.0.1::50051 -p 127.0.0.1::9464 \
  mha-serve:latest >/dev/null
grpc="$(docker port "$project-single" 50051/tcp | head -1)"
metrics="$(docker port "$project-single" 9464/tcp | head -1)"
for _ in $(seq 40); do "$client" health --target "$grpc" >/dev/null 2>&1 && break; sleep 0.25; done
"$client" health --target "$grpc"
"$client" models --target "$grpc" | grep "^demo .*READY" >/dev/null || fail "demo model not READY"
"$client" attend --target "$grpc" --model demo | grep "output \[1, 16, 256\]" >/dev/null ||
  fail "attend on the container"
curl -sf "http://$metrics/metrics" | grep '^mha_requests_total{api="mha.v1",code="OK",model="demo",version="1"} 1$' >/dev/null ||
  fail "/metrics does not count the request"
for _ in $(seq 40); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$project-single")" = healthy ] && break
  sleep 0.5
done
[ "$(docker inspect -f '{{.State.Health.Status}}' "$project-single")" = healthy ] || fail "HEALTHCHECK"
docker stop -t 30 "$project-single" >/dev/null
[ "$(docker inspect -f '{{.State.ExitCode}}' "$project-single")" = 0 ] || fail "exit code on SIGTERM"
docker rm "$project-single" >/dev/null

step "docker run as KServe runs it: one model's folder at /mnt/models, v2 REST on 8080"
kserve_model="$(mktemp -d /var/tmp/mha-kserve.XXXXXX)"
cp -r "$root/models/demo/." "$kserve_model/"
chmod -R a+rX "$kserve_model"
# The args of deploy/kserve/cluster-serving-runtime.yaml, {{.Name}} = attention-layer.
docker run -d --name "$project-kserve" --read-only -v "$kserve_model:/mnt/models:ro" \
  -p 127.0.0.1::8080 mha-serve:latest --model_repository=/mnt/models --model_name=attention-layer \
  --http_port=8080 --port=9000 --metrics_port=9464 --workers=1 >/dev/null
rest="$(docker port "$project-kserve" 8080/tcp | head -1)"
for _ in $(seq 60); do curl -sf "http://$rest/v2/health/ready" >/dev/null && break; sleep 0.25; done
curl -sf "http://$rest/v2/health/ready" >/dev/null || fail "v2 readiness over HTTP"
curl -sf "http://$rest/v2/models/attention-layer/ready" >/dev/null || fail "the model is not served as attention-layer"
python3 -c 'import json; print(json.dumps({"inputs": [{"name": "query", "datatype": "FP32",
  "shape": [1, 3, 256], "data": [0.01 * i for i in range(768)]}]}))' |
  curl -sf "http://$rest/v2/models/attention-layer/infer" -H "Content-Type: application/json" -d @- |
  python3 -c 'import json, sys; out = json.load(sys.stdin)["outputs"][0]
assert out["shape"] == [1, 3, 256] and len(out["data"]) == 768, out["shape"]' ||
  fail "v2 infer over HTTP through the container's port"
docker stop -t 30 "$project-kserve" >/dev/null
[ "$(docker inspect -f '{{.State.ExitCode}}' "$project-kserve")" = 0 ] || fail "exit code on SIGTERM (KServe layout)"
docker rm "$project-kserve" >/dev/null
rm -rf "$kserve_model"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
prom_value() {  # prom_value QUERY: the first sample's value, or 0
  curl -sf --get "http://127.0.0.1:$PROMETHEUS_PORT/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)'
}
export MHA_GRPC_PORT="$(free_port)" MHA_METRICS_PORT="$(free_port)" PROMETHEUS_PORT="$(free_port)"

step "promtool: config, rules, rule unit tests"
quiet docker build -t mha-serve-prometheus:latest "$root/deploy/compose/prometheus"
docker run --rm -v "$root/deploy/compose/prometheus:/rules:ro" --entrypoint sh mha-serve-prometheus:latest -c \
  'promtool check config /etc/prometheus/prometheus.yml && promtool check rules /rules/alerts.yml &&
   cd /rules && promtool test rules alerts_test.yml'

step "compose: server + Prometheus (a copy of models/ mounted, poll mode)"
cd "$root/deploy/compose"
models="$(mktemp -d /var/tmp/mha-models.XXXXXX)"
cp -r "$root/models/demo" "$models/"
chmod -R a+rX "$models"
export MHA_MODELS="$models" MHA_REPOSITORY_POLL_S=1
quiet docker-compose -p "$project" up -d --build
same_image
for _ in $(seq 60); do [ "$(prom_value 'up{job="mha-serve"}')" = 1 ] && break; sleep 1; done
[ "$(prom_value 'up{job="mha-serve"}')" = 1 ] || fail "Prometheus does not see the server up"
curl -sf "http://127.0.0.1:$PROMETHEUS_PORT/api/v1/rules" | grep MhaModelNotLoaded >/dev/null || fail "alert rules not loaded"
before="$(prom_value 'sum(mha_requests_total)')"
"$client" load --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --concurrency 2 --requests 25 >/dev/null
for _ in $(seq 60); do
  after="$(prom_value 'sum(mha_requests_total)')"
  python3 -c "import sys; sys.exit(0 if float('$after') >= float('$before') + 25 else 1)" && break
  sleep 1
done
echo "mha_requests_total through Prometheus: $before -> $after"
python3 -c "import sys; sys.exit(0 if float('$after') >= float('$before') + 25 else 1)" ||
  fail "mha_requests_total did not rise by 25 in Prometheus"

step "compose: a new model version copied in, served without a restart"
"$client" attend --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --len 8 | grep -q "version 1:" ||
  fail "the demo model does not answer as version 1"
started_at="$(docker inspect -f '{{.State.StartedAt}}' "$(docker-compose -p "$project" ps -q mha)")"
mkdir -p "$models/.staging/2"
cp "$root/models/demo/weights.safetensors" "$models/.staging/2/"
chmod -R a+rX "$models"
mv "$models/.staging/2" "$models/demo/2"
for _ in $(seq 60); do
  "$client" attend --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --len 8 2>/dev/null |
    grep -q "version 2:" && break
  sleep 0.5
done
"$client" attend --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --len 8 | grep "version 2:" ||
  fail "version 2 was not served after it was copied into the mounted repository"
[ "$(docker inspect -f '{{.State.StartedAt}}' "$(docker-compose -p "$project" ps -q mha)")" = "$started_at" ] ||
  fail "the server restarted"

step "compose: a session lives through a container restart (--session_spill_dir volume)"
# open: a session of 20 tokens; resume: it is back at 20 and its next step
# equals one Attend over the 21 tokens with is_causal.
session_phase() {
  PYTHONPATH="$root/client/python" python3 - "$MHA_GRPC_PORT" "$1" <<'PY'
import sys
import numpy as np
from mha_client import MhaClient, from_tensor, to_tensor
port, phase = sys.argv[1], sys.argv[2]
x = np.random.default_rng(7).standard_normal((1, 21, 256)).astype(np.float32)
with MhaClient(f"127.0.0.1:{port}", timeout=60, wait_for_ready=True) as c:
    if phase == "open":
        c.open_session("demo", session_id="compose-restart", idle_timeout_s=600).append(x[:, :20])
        sys.exit(0)
    listed = [s for s in c.list_sessions() if s.session_id == "compose-restart"]
    assert listed and listed[0].position == 20, f"not back at position 20: {listed}"
    step = c._stub.Append(c._pb.AppendRequest(session_id="compose-restart", query=to_tensor(x[:, 20:]),
                                              expected_position=20), timeout=60)
    full, _ = c.attend("demo", x, is_causal=True)
    diff = float(np.abs(from_tensor(step.output) - full[:, 20:]).max())
    assert diff < 1e-5, f"the step after the restart differs from Attend by {diff}"
    print(f"the session came back at position 20; its next step equals Attend (max |diff| {diff:.2g})")
PY
}
session_phase open || fail "could not open the session"
quiet docker-compose -p "$project" restart mha
for _ in $(seq 60); do "$client" health --target "127.0.0.1:$MHA_GRPC_PORT" >/dev/null 2>&1 && break; sleep 1; done
docker-compose -p "$project" logs mha 2>&1 | grep -E "sessions (written|restored)" || true
session_phase resume || fail "the session did not live through the restart"
quiet docker-compose -p "$project" down -v
rm -rf "$models"
unset MHA_MODELS MHA_REPOSITORY_POLL_S

step "compose: 3 replicas behind nginx (gRPC, L7)"
quiet docker-compose -p "$project" -f docker-compose.replicas.yml up -d --build --scale mha=3
same_image
for _ in $(seq 40); do "$client" health --target "127.0.0.1:$MHA_GRPC_PORT" >/dev/null 2>&1 && break; sleep 0.5; done
"$client" load --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --concurrency 4 --requests 60 >/dev/null
served=0
for c in $(docker-compose -p "$project" -f docker-compose.replicas.yml ps -q mha); do
  ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$c")"
  n="$(curl -sf "http://$ip:9464/metrics" | awk '/^mha_requests_total\{.*code="OK"/ {s += $2} END {print s + 0}')"
  echo "replica $ip answered $n requests"
  [ "$n" -gt 0 ] && served=$((served + 1))
done
[ "$served" -ge 2 ] || fail "requests reached $served replica(s), expected more than one"

step "compose: sessions stick to the replica that holds them (nginx hashes x-session-id)"
# Without affinity most steps of a session would reach a replica without it
# (NOT_FOUND); mha_client session exits 1 on any failed step or mismatch.
for s in 1 2 3 4 5 6 7 8; do
  "$client" session --target "127.0.0.1:$MHA_GRPC_PORT" --model demo --steps 12 --quiet --seed "$s" \
    | tail -1 | grep -q "bytes freed" || fail "session $s did not complete through the balancer"
done
holders=0
for c in $(docker-compose -p "$project" -f docker-compose.replicas.yml ps -q mha); do
  ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$c")"
  n="$(curl -sf "http://$ip:9464/metrics" | awk '/^mha_append_tokens_total / {print $2 + 0}')"
  echo "replica $ip computed ${n:-0} session tokens"
  [ "${n:-0}" -gt 0 ] && holders=$((holders + 1))
done
[ "$holders" -ge 2 ] || fail "sessions reached $holders replica(s), expected them spread over more"
echo "deploy test passed"
