#!/usr/bin/env bash
# Smoke test of the compose deployment (CI runs it through control-plane/tests/compose_smoke.rs):
#  1. builds the binaries (debug unless --release) and the two images FROM scratch;
#  2. makes a CA and certificates in a temporary directory;
#  3. starts docker-compose.yml under a project name of its own, on ports Docker picks;
#  4. waits for a leader and for every GPU host to be ready (gpuctl from this host, over TLS);
#  5. submits the jobs (50; each prints its GPU and sleeps 1-3 s), finds the leader's container and `docker kill`s it;
#  6. waits until every job has succeeded, reads one job's output (which the replicas fetch
#     from its agent), starts the killed replica again and waits until it has caught up;
#  7. prints the timings.
# Whatever happens it takes the deployment down (`down -v`: containers, network, volumes) and
# removes its images; on a failure it first prints the containers' last log lines.
#
# Usage: deploy/compose/smoke.sh [--release] [--bin-dir DIR] [--jobs N] [--deadline SECS] [--keep]
#   --bin-dir DIR    binaries already built (control-plane, gpuctl, node-agent): no cargo
#   --deadline SECS  how long the jobs may take after the kill (180)
#   --keep           leave the deployment, its images and certificates behind (to look
#                    around); it prints how to reach them and take them down
# Needs docker, docker compose (v2 plugin) or docker-compose (v1), and python3 to read JSON.
# COMPOSE="docker-compose" picks the compose command.
set -euo pipefail
export LC_ALL=C

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
profile=debug
bin_dir=""
jobs=50
deadline=180
keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --release) profile=release; shift ;;
    --bin-dir) bin_dir="$(cd "$2" && pwd)"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --deadline) deadline="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "smoke.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

now_ms() { date +%s%3N; }
t_start=$(now_ms)
log() { printf '[smoke %6.1fs] %s\n' "$(( $(now_ms) - t_start ))e-3" "$*"; }
fail() { log "FAILED: $*" >&2; exit 1; }
secs() { printf '%.1f s' "$(( $2 - $1 ))e-3"; }
# json EXPR: evaluates a Python expression over the JSON document on stdin (as `d`), prints it.
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

if [ -n "${COMPOSE:-}" ]; then
  read -ra dc <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  dc=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  dc=(docker-compose)
else
  fail "neither \`docker compose\` nor docker-compose is installed"
fi
docker info >/dev/null 2>&1 || fail "no Docker daemon answers (docker info)"
command -v python3 >/dev/null || fail "python3 is needed to read gpuctl's JSON"

# Everything this run creates is named after it, so runs side by side do not meet.
run_id="$$-$RANDOM"
project="gpucp-smoke-${run_id}"
export GPUCP_TAG="smoke-${run_id}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpucp-smoke.XXXXXX")"
export GPUCP_TLS_DIR="$tmp/tls"
# Empty: Docker picks free ports on 127.0.0.1; read back with `port`.
export GPUCP_CP1_PORT="" GPUCP_CP2_PORT="" GPUCP_CP3_PORT=""
export GPUCP_CP1_METRICS_PORT="" GPUCP_CP2_METRICS_PORT="" GPUCP_CP3_METRICS_PORT=""
compose=("${dc[@]}" -p "$project" -f "$here/docker-compose.yml")
images_built=""
started=""

cleanup() {
  local rc=$?
  set +e
  if [ -n "$keep" ] && [ -n "$started" ]; then
    log "kept: GPUCTL_ENDPOINTS=${GPUCTL_ENDPOINTS:-} GPUCTL_TLS_DIR=$GPUCP_TLS_DIR/admin"
    log "down: GPUCP_TAG=$GPUCP_TAG GPUCP_TLS_DIR=$GPUCP_TLS_DIR ${compose[*]} down -v; docker image rm gpu-control-plane:$GPUCP_TAG gpu-node-agent:$GPUCP_TAG; rm -r $tmp"
    exit "$rc"
  fi
  if [ -n "$started" ]; then
    if [ "$rc" -ne 0 ]; then
      echo "---- containers ----" >&2
      "${compose[@]}" ps >&2
      echo "---- last log lines ----" >&2
      "${compose[@]}" logs --no-color --tail 40 >&2
    fi
    local t_down
    t_down=$(now_ms)
    if "${compose[@]}" down -v --remove-orphans -t 5 >"$tmp/down.log" 2>&1; then
      log "down -v: $(secs "$t_down" "$(now_ms)")"
    else
      cat "$tmp/down.log" >&2
      echo "smoke: \`${compose[*]} down -v\` failed" >&2
      [ "$rc" -ne 0 ] || rc=1
    fi
  fi
  if [ -n "$images_built" ]; then
    docker image rm "gpu-control-plane:$GPUCP_TAG" "gpu-node-agent:$GPUCP_TAG" >/dev/null 2>&1
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. Binaries and images.
cd "$repo"
if [ -z "$bin_dir" ]; then
  flags=()
  if [ "$profile" = release ]; then flags+=(--release); fi
  log "cargo build ${flags[*]} -p control-plane -p node-agent --bins"
  cargo build "${flags[@]}" -p control-plane -p node-agent --bins
  target_dir="$(cargo metadata --format-version 1 --no-deps | json 'd["target_directory"]')"
  bin_dir="$target_dir/$profile"
  cargo_built=1
fi
gpuctl_bin="$bin_dir/gpuctl"
images_built=1
"$here/build-image.sh" --bin-dir "$bin_dir" "$GPUCP_TAG" 2> >(grep -v -e DEPRECATED -e buildx -e 'docs.docker.com/go/buildx' -e '^ *$' >&2)
t_built=$(now_ms)
what_built="images"
if [ -n "${cargo_built:-}" ]; then what_built="binaries and images"; fi

# 2. Certificates.
"$here/make-certs.sh" --out "$GPUCP_TLS_DIR" "$gpuctl_bin" >/dev/null

# 3. Up.
started=1
t_up=$(now_ms)
log "up: project $project"
if ! "${compose[@]}" up -d >"$tmp/up.log" 2>&1; then
  cat "$tmp/up.log" >&2
  fail "\`${compose[*]} up -d\` failed"
fi
t_up_cmd=$(now_ms)
# Containers by the labels both compose versions put on them (quicker than asking compose).
project_filter=(--filter "label=com.docker.compose.project=$project")
container_of() { docker ps -aq "${project_filter[@]}" --filter "label=com.docker.compose.service=$1"; }
hosts=$(docker ps -a "${project_filter[@]}" --format '{{.Label "com.docker.compose.service"}}' |
  grep -c '^gpu-' || true)
[ "$hosts" -gt 0 ] || fail "no gpu-* containers came up"
declare -A container_of=()
endpoints=""
for svc in cp-1 cp-2 cp-3; do
  container_of[$svc]="$(container_of "$svc")"
  [ -n "${container_of[$svc]}" ] || fail "no container for $svc"
  addr="$(docker port "${container_of[$svc]}" 7001/tcp | head -n 1)"
  [ -n "$addr" ] || fail "$svc publishes no port for 7001"
  endpoints="${endpoints:+$endpoints,}$addr"
done
export GPUCTL_ENDPOINTS="$endpoints" GPUCTL_TLS_DIR="$GPUCP_TLS_DIR/admin"
unset GPUCTL_TOKEN GPUCTL_INSECURE GPUCTL_TENANT
gpuctl() { "$gpuctl_bin" "$@"; }
# Polls give up sooner than gpuctl's default 15 s of retrying (and poll again).
poll() { "$gpuctl_bin" --timeout 3 "$@"; }
log "replicas at $endpoints"

# The id of the replica that leads now (it says so itself), or nothing.
leader_id() {
  poll cluster status -o json 2>/dev/null |
    json 'd["leader"] if d["leader"] and d["leader"] == d["answered_by"] else ""' 2>/dev/null || true
}
ready_nodes() {
  poll nodes -o json 2>/dev/null |
    json 'sum(1 for n in d["nodes"] if n["status"] == "ready")' 2>/dev/null || echo 0
}

# 4. A leader and every GPU host ready.
until_deadline=$(( $(now_ms) + 60000 ))
leader=""
ready=0
while :; do
  [ -n "$leader" ] || leader="$(leader_id)"
  [ -z "$leader" ] || ready="$(ready_nodes)"
  if [ -n "$leader" ] && [ "$ready" -ge "$hosts" ]; then break; fi
  [ "$(now_ms)" -lt "$until_deadline" ] ||
    fail "after 60 s: leader '${leader:-none}', $ready of $hosts GPU hosts ready"
  sleep 0.2
done
t_ready=$(now_ms)
log "replica $leader leads; $ready GPU hosts ready"
gpuctl nodes

# 5. Jobs, eight submitters at a time, then at once the leader's container killed, while most
# of them are still pending or running.
mkdir -p "$tmp/submit"
for i in $(seq 1 "$jobs"); do
  (gpuctl submit -o json -J "smoke-$i" --idempotency-key "$project-$i" -- \
    sh -c "echo smoke-$i on \$CUDA_VISIBLE_DEVICES; exec sleep $(( 1 + i % 3 ))" \
    >"$tmp/submit/$i" 2>&1 || echo "gpuctl submit exited $?" >>"$tmp/submit/$i") &
  if [ $(( i % 8 )) -eq 0 ]; then wait; fi
done
wait
ids=()
for i in $(seq 1 "$jobs"); do
  out="$(cat "$tmp/submit/$i")"
  [[ "$out" =~ \"id\":([0-9]+) ]] || fail "submitting job $i: $out"
  ids+=("${BASH_REMATCH[1]}")
done
t_submitted=$(now_ms)
log "submitted ${#ids[@]} jobs"

# The leader's address names its service (cp-N:7001); the status is re-read so the kill hits
# whichever replica leads now.
status="$(gpuctl cluster status -o json)" || fail "no cluster status after the submissions"
read -r leader service < <(json "' '.join(str(x) for x in next(((m['id'], m['address'].split(':')[0])
  for m in d['members'] if m['id'] == d['leader'] == d['answered_by']), ()))" <<<"$status") || true
[ -n "${leader:-}" ] || fail "no leader just after the jobs were submitted: $status"
container="${container_of[$service]:-}"
[ -n "$container" ] || fail "the leader's address names no service of ours: $service"
poll queue -o json >"$tmp/queue-at-kill.json" 2>/dev/null || true
docker kill "$container" >/dev/null
t_kill=$(now_ms)
in_flight="$(json '", ".join("%d %s" % (n, s) for s, n in
  sorted(__import__("collections").Counter(j["state"] for j in d["jobs"]).items()))' \
  <"$tmp/queue-at-kill.json" 2>/dev/null)" || in_flight="?"
log "killed $service (replica $leader, the leader); jobs then: ${in_flight:-none left}"

new_leader=""
until_deadline=$(( t_kill + 30000 ))
while :; do
  new_leader="$(leader_id)"
  if [ -n "$new_leader" ] && [ "$new_leader" != "$leader" ]; then break; fi
  [ "$(now_ms)" -lt "$until_deadline" ] || fail "no new leader 30 s after the kill"
  sleep 0.05
done
t_new_leader=$(now_ms)
log "replica $new_leader leads, $(( t_new_leader - t_kill )) ms after the kill"

# 6. Every job succeeds.
id_list="$(IFS=,; echo "${ids[*]}")"
# One line per job of ours: ID STATE NODE RUNS (NODE: where it was last placed; RUNS: how
# many times it started running).
our_jobs() {
  poll queue -a -o json | json "'\\n'.join('%s %s %s %d' % (j['id'], j['state'],
    ([h['reason'][len('placed on '):] for h in j['history']
      if h['state'] == 'scheduled' and h['reason'].startswith('placed on ')] or ['-'])[-1],
    sum(1 for h in j['history'] if h['state'] == 'running')) for j in d['jobs'] if j['id'] in {$id_list})"
}
# count STATE...: how many lines of $snapshot are in one of the states.
count() { awk -v states=" $* " 'index(states, " " $2 " ") { n++ } END { print n + 0 }' <<<"$snapshot"; }
until_deadline=$(( t_kill + deadline * 1000 ))
last_report=$(now_ms)
snapshot=""
while :; do
  snapshot="$(our_jobs 2>/dev/null)" || snapshot=""
  summary="$(awk 'NF { print $2 }' <<<"$snapshot" | sort | uniq -c | awk '{ printf "%s %s, ", $1, $2 }')"
  summary="${summary%, }"
  if [ "$(count failed cancelled timed_out)" -gt 0 ]; then
    gpuctl queue -a >&2 || true
    fail "a job did not succeed: $summary"
  fi
  [ "$(count succeeded)" -lt "$jobs" ] || break
  [ "$(now_ms)" -lt "$until_deadline" ] ||
    fail "$deadline s after the kill, not every job has succeeded: ${summary:-no answer}"
  if [ $(( $(now_ms) - last_report )) -ge 5000 ]; then
    log "jobs: ${summary:-no answer}"
    last_report=$(now_ms)
  fi
  sleep 0.25
done
t_done=$(now_ms)
log "all $jobs jobs succeeded"
per_node="$(awk '{ print $3 }' <<<"$snapshot" | sort | uniq -c | awk '{ printf "%s %s, ", $2, $1 }')"
per_node="${per_node%, }"
restarted="$(awk '$4 > 1 { n++ } END { print n + 0 }' <<<"$snapshot")"
# A job's output, which a replica fetches from the agent at the address it advertised.
logs="$(gpuctl logs "${ids[0]}")" || fail "gpuctl logs ${ids[0]} failed"
[[ "$logs" == *"smoke-1 on GPU-"* ]] || fail "job ${ids[0]} logged '$logs', not its GPU"
log "job ${ids[0]} logged: $logs"

# The killed replica comes back with its volume and catches up.
docker start "$container" >/dev/null
t_restart=$(now_ms)
until_deadline=$(( t_restart + 60000 ))
while :; do
  back="$(poll cluster status -o json 2>/dev/null | json "
next((m['reachable'] and m['lag'] is not None and m['lag'] <= 16 for m in d['members'] if m['id'] == $leader and d['leader'] == d['answered_by']), False)" 2>/dev/null || true)"
  [ "$back" != True ] || break
  [ "$(now_ms)" -lt "$until_deadline" ] || fail "replica $leader has not caught up 60 s after its restart"
  sleep 0.2
done
t_back=$(now_ms)
gpuctl cluster status

row() { printf '  %-38s %s\n' "$1" "$2"; }
echo "smoke: PASSED ($jobs jobs, $hosts simulated GPU hosts, 3 replicas, TLS)"
row "build ($what_built)" "$(secs "$t_start" "$t_built")"
row "up -> leader and $hosts hosts ready" "$(secs "$t_up" "$t_ready") ($(secs "$t_up" "$t_up_cmd") of it in \`up -d\`)"
row "submit $jobs jobs (8 at a time)" "$(secs "$t_ready" "$t_submitted")"
row "kill of the leader -> new leader" "$(( t_new_leader - t_kill )) ms (replica $leader killed; replica $new_leader leads)"
row "kill -> all $jobs jobs succeeded" "$(secs "$t_kill" "$t_done")"
row "first submit -> all $jobs succeeded" "$(secs "$t_ready" "$t_done")"
row "killed replica restarted -> caught up" "$(secs "$t_restart" "$t_back")"
row "total (before down)" "$(secs "$t_start" "$(now_ms)")"
row "jobs per host" "$per_node"
row "jobs that started more than once" "$restarted"
