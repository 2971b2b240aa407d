#!/usr/bin/env bash
# Run the deployment artifacts for real, on this machine, and say what held.
#
#   scripts/deploy_check.sh [images] [pod] [systemd] [quickstart]     (default: all four, in that order)
#
#   images      the base image made locally (deploy/containers/base-image.sh, unless it exists), then
#               deploy/containers/build.sh: the CPU server image and the kvctl image; their users and sizes
#   pod         podman kube play deploy/k8s/kvctl-sidecar.yaml with SmolLM2 (sized to this box, the
#               changes printed): kvctl ready, a chat and the WebUI through kvctl with a client key, a
#               burst that overflows the pool, then the preStop drain under a burst and the pod's stop;
#               then the llm-d variant's pod (deploy/k8s/llm-d/kvctl-llama.yaml): ready, a chat, and
#               the gauges its endpoint picker reads
#   systemd     deploy/systemd's units under systemd in a container, set up as deploy/README.md says:
#               both started, a chat, `systemctl reload kvctl` with a changed setting under a burst,
#               `systemctl stop kvctl` under streams, `systemd-analyze security`
#   quickstart  scripts/quickstart.sh --demo, timed, with the server's build cached but a new virtual
#               environment and model download
#
# Root on Debian 12 (podman is rootful here: the units' sandboxing needs a privileged container). Installs
# podman, buildah, mmdebstrap and runc if missing. About 11 min on 2 cores the first time (the server
# image compiles llama.cpp), 3 min once the images are built. Too long for CI: the README names it, and
# deploy/README.md records its last result. The log is also written to DEPLOY_CHECK_LOG
# (default: deploy-check.log in the checkout, ignored by git).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log="${DEPLOY_CHECK_LOG:-$root/deploy-check.log}"
exec > >(tee "$log") 2>&1

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(images pod systemd quickstart)
for s in "${steps[@]}"; do
    case "$s" in
        images|pod|systemd|quickstart) ;;
        *) echo "deploy_check: unknown step: $s (images, pod, systemd, quickstart)" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "deploy_check: run as root (rootful podman)" >&2; exit 2; }
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
reg=localhost/kvctl
server_image="$reg/llama-server:$version" kvctl_image="$reg/kvctl:$version"
work="$(mktemp -d -t kvctl-deploy-check.XXXXXX)"
chmod 0700 "$work"
results="$work/results"   # one "PASS  name" or "FAIL  name" a line: each step runs in a subshell
: >"$results"
t_start=$SECONDS
say() { printf '\ndeploy_check: %s\n' "$*"; }
pass() { echo "PASS  $1" >>"$results"; printf 'deploy_check: PASS %s\n' "$1"; }
fail() { echo "FAIL  $1" >>"$results"; printf 'deploy_check: FAIL %s\n' "$1"; }
check() {  # check NAME CMD...: run CMD, record whether it exited 0, return its status
    local name="$1"; shift
    if "$@"; then pass "$name"; else fail "$name"; return 1; fi
}
cleanup() {
    local rc=$?
    podman pod rm -f kvctl-llama-pod-0 >/dev/null 2>&1 || true
    podman rm -f kvctl-systemd >/dev/null 2>&1 || true
    podman secret rm kvctl-admin kvctl-peer kvctl-api-keys >/dev/null 2>&1 || true
    podman volume rm -f llama-models kvctl-api-keys >/dev/null 2>&1 || true
    say "summary ($(( (SECONDS - t_start) / 60 )) min $(( (SECONDS - t_start) % 60 )) s; $(date -u +%Y-%m-%dT%H:%MZ); $(git describe --always --dirty); $(grep -c '' "$results") checks)"
    sed 's/^/  /' "$results"
    grep -q '^FAIL' "$results" && rc=1
    [ -s "$results" ] || rc=1
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

# --- tools and podman's settings for this machine ---------------------------------------------
missing=()
for t in podman buildah mmdebstrap runc nsenter curl openssl; do command -v "$t" >/dev/null || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing what is missing of: ${missing[*]}"
    apt-get update -qq
    apt-get install -y --no-install-recommends podman buildah mmdebstrap runc uidmap curl openssl util-linux >/dev/null
fi
# runc, not crun: crun refuses a host with cgroups v1 and v2 mounted together; the containers' limits no
# higher than this process's own hard limits (it may lack CAP_SYS_RESOURCE)
nofile="$(ulimit -Hn)" nproc="$(ulimit -Hu)"
[ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n[engine]\nruntime = "runc"\n' \
    "$nofile" "$nofile" "$nproc" "$nproc" >"$work/containers.conf"
export CONTAINERS_CONF="$work/containers.conf"
# a build host behind a TLS-inspecting proxy (CAs of its own in /usr/local/share/ca-certificates): the
# image builds read its CA bundle through a mount, for their build stages only; no image keeps it
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    export BUILD_ARGS="-v /etc/ssl/certs/ca-certificates.crt:/run/build-ca.crt:ro --build-arg CA_BUNDLE=/run/build-ca.crt"
fi

venv="${KVCTL_VENV:-$root/.venv}"
if ! "$venv/bin/python" -c 'import openai, yaml, prometheus_client' 2>/dev/null; then
    say "installing kvctl with the demo's tools into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -e ".[demo]" pyyaml
fi
py="$venv/bin/python"
model="$("$py" -m testkit.realmodels path smollm2)"
in_netns() {  # in_netns PID CMD...: CMD in that process's network namespace (kvctl listens on its loopback)
    local pid="$1"; shift
    nsenter -t "$pid" -n "$@"
}
wait_ready() {  # wait_ready PID SECONDS: kvctl's /readyz answers 200 in that namespace
    for _ in $(seq "$2"); do
        in_netns "$1" curl -fsS -o /dev/null 127.0.0.1:8091/readyz 2>/dev/null && return 0
        sleep 1
    done
    return 1
}

# --- images -----------------------------------------------------------------------------------
step_images() {
    say "images: the base image, then deploy/containers/build.sh"
    deploy/containers/base-image.sh
    local t0=$SECONDS
    if deploy/containers/build.sh server kvctl; then
        pass "images: built in $(( SECONDS - t0 )) s"
    else
        fail "images: deploy/containers/build.sh"; return 1
    fi
    local img
    for img in "$server_image" "$kvctl_image"; do
        check "images: $img runs as $(podman image inspect -f '{{.Config.User}}' "$img"), $(( $(podman image inspect -f '{{.Size}}' "$img") / 1000000 )) MB" \
            test "$(podman image inspect -f '{{.Config.User}}' "$img")" = 10001:10001
    done
    check "images: llama-server --version in its image" podman run --rm "$server_image" --version
    check "images: kvctl --version in its image" podman run --rm "$kvctl_image" kvctl --version
}

# --- the pod ----------------------------------------------------------------------------------
step_pod() {
    play_pod deploy/k8s/kvctl-sidecar.yaml full
    # the llm-d variant's pod (its InferencePool, HTTPRoute and endpoint picker need a cluster)
    play_pod deploy/k8s/llm-d/kvctl-llama.yaml picker
}

play_pod() {  # play_pod MANIFEST full|picker
    local manifest="$1" what="$2" name
    name="$(basename "$manifest" .yaml)"
    say "pod: podman kube play $manifest"
    local pod=kvctl-llama-pod-0 key token peer
    rm -f "$work/pod.yaml"
    podman pod rm -f "$pod" >/dev/null 2>&1 || true
    podman volume rm -f llama-models >/dev/null 2>&1 || true
    # the PersistentVolumeClaim llama-models is podman's named volume of that name
    podman volume create llama-models >/dev/null
    install -m 0644 "$model" "$(podman volume inspect -f '{{.Mountpoint}}' llama-models)/model.gguf"
    # the three Secrets of the manifest's header, as podman secrets: podman reads an env secret as a JSON
    # map of base64 values and a volume secret as a Kubernetes Secret, whose data podman 4.3 writes to
    # the file without decoding it (and keeps in a named volume of the secret's name)
    key="$(openssl rand -hex 16)" token="$(openssl rand -hex 16)" peer="$(openssl rand -hex 16)"
    b64() { printf '%s' "$1" | base64 -w0; }
    local keys_data
    keys_data="$(b64 "$key deploy-check")"
    case "$(podman version --format '{{.Client.Version}}')" in 4.[0-3].*) keys_data="$key deploy-check" ;; esac
    # the client key and the admin token reach the checks by environment and file, never on a command line
    export KVCTL_CHECK_API_KEY="$key" KVCTL_CHECK_TOKEN="$token"
    printf 'Authorization: Bearer %s\n' "$key" >"$work/auth.hdr"
    printf '{"token": "%s"}' "$(b64 "$token")" >"$work/admin.json"
    printf '{"key": "%s"}' "$(b64 "$peer")" >"$work/peer.json"
    printf '{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kvctl-api-keys"}, "data": {"keys": "%s"}}' \
        "$keys_data" >"$work/keys.json"
    podman secret rm kvctl-admin kvctl-peer kvctl-api-keys >/dev/null 2>&1 || true
    podman volume rm -f kvctl-api-keys >/dev/null 2>&1 || true
    podman secret create kvctl-admin "$work/admin.json" >/dev/null
    podman secret create kvctl-peer "$work/peer.json" >/dev/null
    podman secret create kvctl-api-keys "$work/keys.json" >/dev/null
    say "$name: what differs from the manifest on this box"
    "$py" -m testkit.deploycheck pod-yaml "$manifest" "$work/pod.yaml" --server-image "$server_image"
    check "$name: podman kube play" podman kube play "$work/pod.yaml" || return 1
    local infra pid
    infra="$(podman pod inspect -f '{{.InfraContainerID}}' "$pod")"
    pid="$(podman inspect -f '{{.State.Pid}}' "$infra")"
    podman ps --pod --filter "pod=$pod" --format '  {{.Names}} {{.Status}} user={{.Labels}}' | cut -c1-100
    check "$name: kvctl's /readyz 200 (the readiness probe's URL) within 180 s" wait_ready "$pid" 180
    check "$name: both containers run as uid 10001 (runAsUser)" \
        test "$(podman exec "$pod-kvctl" id -u) $(podman exec "$pod-llama-server" id -u)" = "10001 10001"
    # podman runs the livenessProbe as a healthcheck (curl in the container) on a systemd timer; without
    # systemd, as here, run it by hand. It has no readinessProbe: the check asks /readyz itself, above
    check "$name: the liveness probe (podman healthcheck run)" podman healthcheck run "$pod-kvctl"
    check "$name: a request without a client key gets 401" \
        test "$(in_netns "$pid" curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8080/v1/models)" = 401
    check "$name: a chat through kvctl answers" in_netns "$pid" "$py" -m testkit.deploycheck chat --proxy http://127.0.0.1:8080
    check "$name: the WebUI through kvctl" sh -c "nsenter -t $pid -n curl -fsS --compressed -H @$work/auth.hdr 127.0.0.1:8080/ | grep -qi '<html'"
    if [ "$what" = picker ]; then
        # what the endpoint picker's engine config (k8s/llm-d/endpoint-picker.yaml) reads, on the proxy port
        local m
        for m in $(sed -n 's/^ *[a-zA-Z]*Spec: \(kvctl_[a-z_]*\).*/\1/p' deploy/k8s/llm-d/endpoint-picker.yaml); do
            check "$name: GET :8080/metrics (no key, as the picker scrapes) serves $m" \
                sh -c "nsenter -t $pid -n curl -fsS 127.0.0.1:8080/metrics | grep -q '^$m'"
        done
    else
        check "$name: an overflowing burst (4 chats of 640 tokens, 2048 cells) completes with parks" \
            in_netns "$pid" "$py" -m testkit.deploycheck burst --proxy http://127.0.0.1:8080 \
            --admin http://127.0.0.1:8091
        # podman does not run lifecycle hooks: run the kvctl container's preStop as the kubelet would, under
        # a burst, then stop the pod as the kubelet does (SIGTERM, terminationGracePeriodSeconds)
        check "$name: the preStop drain (kvctl drain --json) under a burst: every chat whole" \
            in_netns "$pid" "$py" -m testkit.deploycheck burst --proxy http://127.0.0.1:8080 \
            --admin http://127.0.0.1:8091 --chats 2 --tokens 160 --min-parks 0 \
            --during "podman exec $pod-kvctl kvctl drain --json"
    fi
    # then SIGTERM in the kubelet's order: kvctl, then the server (after its preStop sleep). Not `podman
    # pod stop`: in a pod that shares its PID namespace it SIGKILLs the containers with the infra
    # container, their PID 1
    local t0=$SECONDS
    check "$name: SIGTERM to kvctl (podman stop -t 75)" podman stop -t 75 "$pod-kvctl"
    check "$name: SIGTERM to the server (podman stop -t 75)" podman stop -t 75 "$pod-llama-server"
    say "$name: stopped in $(( SECONDS - t0 )) s; kvctl's and the server's last lines:"
    podman logs --tail 4 "$pod-kvctl" 2>&1 | cut -c1-240
    podman logs --tail 6 "$pod-llama-server" 2>&1 | cut -c1-240
    local codes
    codes="$(podman inspect -f '{{.State.ExitCode}}' "$pod-kvctl"),$(podman inspect -f '{{.State.ExitCode}}' "$pod-llama-server")"
    check "$name: kvctl and the server exited 0 (exit codes: $codes)" test "$codes" = "0,0"
    podman pod stop "$pod" >/dev/null 2>&1 || true
    podman pod rm -f "$pod" >/dev/null
}

# --- systemd ----------------------------------------------------------------------------------
step_systemd() {
    say "systemd: deploy/systemd's units under systemd in a container"
    local c=kvctl-systemd image=localhost/kvctl-check/systemd pid
    podman build --layers -q -f tests/deploy/systemd.Containerfile --build-arg "SERVER_IMAGE=$server_image" \
        --build-arg "KVCTL_IMAGE=$kvctl_image" -t "$image" . >/dev/null || { fail "systemd: image"; return 1; }
    podman rm -f "$c" >/dev/null 2>&1 || true
    podman run -d --name "$c" --privileged --systemd=always "$image" >/dev/null
    pid="$(podman inspect -f '{{.State.Pid}}' "$c")"
    sx() { podman exec "$c" "$@"; }
    for _ in $(seq 30); do sx systemctl is-system-running 2>/dev/null | grep -qE 'running|degraded' && break; sleep 1; done
    podman cp "$model" "$c:/srv/models/model.gguf"
    sx chmod 0644 /srv/models/model.gguf
    # the operator's edits of deploy/README.md step 4, sized to this box (a pool of 2048 cells, one thread)
    sx sed -i -e 's/^LLAMA_ARG_CTX_SIZE=.*/LLAMA_ARG_CTX_SIZE=2048/' -e 's/^LLAMA_ARG_N_PARALLEL=.*/LLAMA_ARG_N_PARALLEL=4/' \
        -e 's/^LLAMA_ARG_PARK_RAM=.*/LLAMA_ARG_PARK_RAM=512/' -e 's/^LLAMA_SERVER_ARGS=.*/LLAMA_SERVER_ARGS=-t 1/' \
        /etc/kvctl/llama-server.env
    sx sed -i 's/^# *KVCTL_POLICY__SNAPSHOT_BUDGET_MIB=.*/KVCTL_POLICY__SNAPSHOT_BUDGET_MIB=512/' /etc/kvctl/kvctl.env
    check "systemd: systemctl enable --now llama-server.service kvctl.service" \
        sx systemctl enable --now llama-server.service kvctl.service
    check "systemd: kvctl's /readyz 200 within 180 s" wait_ready "$pid" 180
    check "systemd: kvctl.service active (Type=notify: READY=1 once it polled the server)" \
        sx systemctl is-active --quiet kvctl.service
    sx systemctl --no-pager status kvctl.service llama-server.service | grep -E '●|Active:|Main PID' || true
    check "systemd: a chat through kvctl answers" in_netns "$pid" "$py" -m testkit.deploycheck chat --proxy http://127.0.0.1:8080
    local main0 high worker0 worker1
    main0="$(sx systemctl show -p MainPID --value kvctl.service)"
    worker() { in_netns "$pid" curl -fsS 127.0.0.1:8091/status | "$py" -c 'import json,sys; print(json.load(sys.stdin)["keeper"]["pid"])'; }
    worker0="$(worker)"
    check "systemd: systemctl reload kvctl (KVCTL_POLICY__HIGH=0.9 in kvctl.env) under a burst: every chat whole" \
        in_netns "$pid" "$py" -m testkit.deploycheck burst --proxy http://127.0.0.1:8080 --admin http://127.0.0.1:8091 \
        --during "podman exec $c sh -c \"sed -i 's/^# *KVCTL_POLICY__HIGH=.*/KVCTL_POLICY__HIGH=0.9/' /etc/kvctl/kvctl.env && systemctl reload kvctl\""
    high="$(in_netns "$pid" curl -fsS 127.0.0.1:8091/status | "$py" -c 'import json,sys; print(json.load(sys.stdin)["pool"]["high"])' 2>&1 || true)"
    worker1="$(worker)"
    local main1
    main1="$(sx systemctl show -p MainPID --value kvctl.service)"
    check "systemd: after the reload /status has HIGH $high, the same main PID (the keeper: $main0, $main1), a new worker ($worker0, $worker1)" \
        test "$high $main1" = "0.9 $main0" -a -n "$worker0" -a "$worker0" != "$worker1"
    check "systemd: systemctl stop kvctl under 2 streams: both whole (the drain)" \
        in_netns "$pid" "$py" -m testkit.deploycheck burst --proxy http://127.0.0.1:8080 --admin http://127.0.0.1:8091 \
        --chats 2 --tokens 160 --min-parks 0 --no-after --during "podman exec $c systemctl stop kvctl"
    check "systemd: kvctl.service stopped cleanly (Result=success)" \
        test "$(sx systemctl show -p Result --value kvctl.service)" = success
    say "systemd: systemd-analyze security"
    sx systemd-analyze security --no-pager llama-server.service kvctl.service 2>/dev/null | grep -i 'overall exposure' || true
    check "systemd: both units expose 2.0 or less (systemd-analyze security --threshold=20)" sh -c \
        "podman exec $c systemd-analyze security --no-pager --threshold=20 llama-server.service kvctl.service >/dev/null"
    say "systemd: kvctl's journal (JSON lines), last 3"
    sx journalctl -u kvctl.service -o cat --no-pager | tail -n 3 | cut -c1-240
    podman rm -f "$c" >/dev/null
}

# --- the quickstart ---------------------------------------------------------------------------
step_quickstart() {
    # what a newcomer waits for once the server is built: a new virtual environment, the model's
    # download, the stack's start, the question and the burst
    say "quickstart: scripts/quickstart.sh --demo with a new venv and model folder (the server's build cached first)"
    scripts/build_llama.sh >/dev/null
    local t0=$SECONDS
    if KVCTL_VENV="$work/venv" KVCTL_MODELS_DIR="$work/models" scripts/quickstart.sh --demo --cpu; then
        pass "quickstart: --demo completed in $(( SECONDS - t0 )) s"
        check "quickstart: within 3 minutes" test $(( SECONDS - t0 )) -le 180
    else
        fail "quickstart: --demo"
    fi
}

for s in "${steps[@]}"; do
    # a subshell with errexit: a failed setup command ends the step, which is recorded, and the next runs
    set +e
    ( set -e; "step_$s" )
    rc=$?
    set -e
    [ "$rc" = 0 ] || fail "$s: stopped early (exit $rc; the output above says where)"
done
