"""deploy/: the systemd units verify, every setting is documented, and the dashboard, the alerts and
the Kubernetes manifest only use what kvctl and the patched server really export and accept.

External validators: `systemd-analyze` (package systemd) and `promtool` (package prometheus). Where
one is missing the test is skipped with the reason, except under CI (the `CI` variable set), where
a missing validator fails: CI must not go green without having checked. Kubernetes schemas are
checked with `kubeconform` or `kubernetes-validate` (its script, or else its Python API, a test
dependency); the structure and the settings of the manifest are checked always.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from controller.proxy.app import DRAIN_GRACE_S
from controller.settings import Settings, load_settings, split_host_port
from tests.harness import K8S_MIN_VERSION, require_module

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
UNITS = ("llama-server.service", "kvctl.service")
DASHBOARD = DEPLOY / "grafana" / "kvctl-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus"
K8S = DEPLOY / "k8s" / "kvctl-sidecar.yaml"
DEFAULTS = Settings()
PROXY_PORT = split_host_port(DEFAULTS.proxy.listen)[1]
ADMIN_PORT = split_host_port(DEFAULTS.admin.listen)[1]
SERVER_PORT = DEFAULTS.upstream.url.port


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVCTL_"):
            monkeypatch.delenv(key)


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (apt-get install -y {package})"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; under CI a missing validator is a failure, not a skip")
    pytest.skip(reason)


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvctl_deploy_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- systemd ---------------------------------------------------------------------------------


def unit_directives(path: Path) -> dict[str, list[str]]:
    """Key -> every value it is given (systemd units repeat keys), comments and sections dropped."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def exec_binaries(path: Path) -> Iterator[str]:
    for key, values in unit_directives(path).items():
        if key.startswith("Exec"):
            for value in values:
                yield value.lstrip("-@:+!").split()[0]


def system_unit_dir() -> Path:
    for candidate in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(candidate, "sysinit.target").exists():
            return Path(candidate)
    pytest.fail("systemd-analyze is installed but no system unit directory with sysinit.target was found")


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """The units exactly as shipped, in a scratch root whose only additions are stub executables at
    the paths the units name (verify refuses a unit whose ExecStart= binary does not exist)."""
    analyze = require_tool("systemd-analyze", "systemd")
    root = tmp_path / "root"
    units = root / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    # the targets every service depends on implicitly (sysinit.target, ...), from the host
    shutil.copytree(system_unit_dir(), root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    for name in UNITS:
        shutil.copy(SYSTEMD / name, units / name)
        for binary in exec_binaries(SYSTEMD / name):
            assert binary.startswith("/"), f"{name}: {binary} must be an absolute path"
            stub = root / binary.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\nexit 0\n")
            stub.chmod(0o755)
    proc = subprocess.run(
        [analyze, "verify", f"--root={root}", *UNITS], capture_output=True, text=True, timeout=120, check=False
    )
    output = (proc.stdout + proc.stderr).strip()
    # verify only warns about unknown keys and invalid values: any output at all is a failure
    assert proc.returncode == 0 and not output, output


def test_systemd_units_keep_kvctl_beside_the_server() -> None:
    server = unit_directives(SYSTEMD / "llama-server.service")
    kvctl = unit_directives(SYSTEMD / "kvctl.service")
    # a server restart must not stop kvctl: no hard dependency on the server
    assert kvctl["Wants"] == ["llama-server.service"]
    assert "llama-server.service" in " ".join(kvctl["After"]).split()
    for hard in ("BindsTo", "Requires", "Requisite", "PartOf"):
        assert hard not in kvctl, f"kvctl.service must not use {hard}="
    # the keeper is the main process; its worker (a child) notifies
    assert kvctl["Type"] == ["notify"] and kvctl["NotifyAccess"] == ["all"]
    assert kvctl["ExecReload"] == ["/opt/kvctl/bin/kvctl reload --environment"]
    assert kvctl["WatchdogSec"], "kvctl sends WATCHDOG=1; the unit must ask for it"
    # the same user, so psutil in kvctl can read the server's /proc entries
    assert server["User"] == kvctl["User"] and server["User"] != ["root"]
    for unit in (server, kvctl):
        assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectSystem"] == ["strict"]
        # PrivateDevices=yes hides the GPU from CUDA and NVML; ProcSubset=pid hides /proc/meminfo
        assert unit.get("PrivateDevices", ["no"]) == ["no"]
        assert unit.get("ProcSubset", ["all"]) == ["all"]
    argv = server["ExecStart"][0].split()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert int(argv[argv.index("--port") + 1]) == SERVER_PORT
    assert {"-kvu", "--slots", "--metrics"} <= set(argv)
    assert kvctl["EnvironmentFile"] == ["/etc/kvctl/kvctl.env"]
    # the drain and the spawned server's stop fit inside systemd's stop timeout
    defaults = load_settings()
    stop_s = int(kvctl["TimeoutStopSec"][0].removesuffix("s"))
    assert stop_s >= defaults.proxy.drain_s + DRAIN_GRACE_S + defaults.supervisor.stop_timeout_s
    assert server["EnvironmentFile"] == ["/etc/kvctl/llama-server.env"]


def env_file_assignments(path: Path) -> dict[str, str]:
    """NAME -> value of every `NAME=value` line, commented (`#NAME=`) or not, unquoted as systemd does."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"#?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if m:
            value = m.group(2).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[m.group(1)] = value
    return out


def test_kvctl_env_lists_every_setting_with_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = load_script(SYSTEMD / "gen_env.py")
    listed = {k: v for k, v in env_file_assignments(SYSTEMD / "kvctl.env").items() if k.startswith("KVCTL_")}
    expected: dict[str, str] = {}
    for path, field, group in gen.settings_fields():
        if group is None:
            default = gen.env_default(gen.field_default(field))
            expected[gen.env_name(path)] = "" if default is None else default.strip("'")
    missing = sorted(set(expected) - set(listed))
    unknown = sorted(set(listed) - set(expected))
    hint = "regenerate with: python deploy/systemd/gen_env.py"
    assert not missing, f"kvctl.env lacks {missing}; {hint}"
    assert not unknown, f"kvctl.env names settings that do not exist: {unknown}; {hint}"
    stale = {k: (listed[k], v) for k, v in expected.items() if listed[k] != v}
    assert not stale, f"kvctl.env shows stale defaults (file, model): {stale}; {hint}"
    # uncommenting every line must give exactly the defaults
    for name, value in listed.items():
        if value:
            monkeypatch.setenv(name, value)
    assert load_settings() == DEFAULTS


def test_llama_server_env_sets_the_model_and_the_park_budget() -> None:
    env = env_file_assignments(SYSTEMD / "llama-server.env")
    assert env["LLAMA_ARG_MODEL"].endswith(".gguf")
    # the smaller of the two budgets applies; shipping them equal avoids a surprise
    assert int(env["LLAMA_ARG_PARK_RAM"]) == DEFAULTS.policy.snapshot_budget_mib
    assert float(env["LLAMA_ARG_PARK_LEASE"]) == DEFAULTS.upstream.lease_s
    assert "LLAMA_SERVER_ARGS" in env


# --- metric names ----------------------------------------------------------------------------

# What llama-server itself exports at the pinned tree (tools/server/server-task.cpp,
# server_task_result_metrics::to_metrics()); the patches' additions are in docs/patches.md's table.
LLAMA_CPP_BUILTIN = {
    "llamacpp:" + name
    for name in (
        "prompt_tokens_total",
        "prompt_tokens_cached_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
        "n_tokens_max",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_num_drafts_total",
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "requests_processing",
        "requests_deferred",
        "n_busy_slots_per_decode",
    )
}
PROMETHEUS_BUILTIN = {"up"}  # added by Prometheus to every target

COLLECTOR_SAMPLES = {
    "Counter": lambda n: {n.removesuffix("_total") + "_total"},
    "Gauge": lambda n: {n},
    "Histogram": lambda n: {n + "_bucket", n + "_sum", n + "_count"},
    "Summary": lambda n: {n, n + "_sum", n + "_count"},
    "Info": lambda n: {n + "_info"},
    "Enum": lambda n: {n},
}


def kvctl_metric_names() -> set[str]:
    """Every series name kvctl's collectors export, read from the source (no import needed)."""
    names: set[str] = set()
    for path in (ROOT / "controller").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if kind not in COLLECTOR_SAMPLES:
                continue
            args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "name")]
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("kvctl_"):
                    names |= COLLECTOR_SAMPLES[kind](arg.value)
    return names


def server_metric_names() -> set[str]:
    doc = (ROOT / "docs" / "patches.md").read_text()
    patched = set(re.findall(r"^\|\s*`(llamacpp:[a-z0-9_:]+)`", doc, re.MULTILINE))
    return patched | LLAMA_CPP_BUILTIN


def exported_metric_names() -> set[str]:
    return kvctl_metric_names() | server_metric_names() | PROMETHEUS_BUILTIN


_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+")
_RANGE = re.compile(r"\[[^\]]*\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (Grafana variables allowed)."""
    s = _GRAFANA_VAR.sub("0", _STRING.sub('""', expr))
    s = _MATCHERS.sub("", _RANGE.sub("", s))
    s = _GROUPING.sub("", s)
    return {name for name, call in _IDENT.findall(s) if not call and name.lower() not in _KEYWORDS}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le, replica) (rate(a_bucket{x=~"$replica"}[$__rate_interval]))', {"a_bucket"}),
        (
            "llamacpp:kv_cells_used / (llamacpp:kv_cells > 0)",
            {"llamacpp:kv_cells_used", "llamacpp:kv_cells"},
        ),
        ("vector($budget_mib * 1048576)", set()),
        ("x > 0.9 * 8192 and on (replica) y == 1", {"x", "y"}),
        ("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m]))) offset 1h", {"b_bucket"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_the_exported_names_are_found() -> None:
    kvctl = kvctl_metric_names()
    assert {"kvctl_upstream_up", "kvctl_parks_total", "kvctl_park_duration_seconds_bucket"} <= kvctl
    assert "llamacpp:kv_cache_usage_ratio" in server_metric_names()


def dashboard_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            for t in sub.get("targets", []):
                yield sub["title"], t["expr"]


def test_dashboard_is_what_the_generator_gives() -> None:
    gen = load_script(DEPLOY / "grafana" / "gen_dashboard.py")
    assert gen.main(["--check"]) == 0, "regenerate with: python deploy/grafana/gen_dashboard.py"


def test_dashboard_is_provisionable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvctl-overview" and dashboard["id"] is None
    assert "__inputs" not in dashboard, "__inputs placeholders break file provisioning"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    # the thresholds the dashboard draws are kvctl's defaults
    assert float(variables["high"]["query"]) == DEFAULTS.policy.high
    assert float(variables["low"]["query"]) == DEFAULTS.policy.low
    assert int(variables["budget_mib"]["query"]) == DEFAULTS.policy.snapshot_budget_mib


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metric_names()
    used: set[str] = set()
    for title, expr in dashboard_targets(dashboard):
        names = promql_metric_names(expr)
        unknown = names - exported
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, which neither kvctl nor llama-server exports"
        used |= names
    for panel in dashboard["panels"]:
        listed = set(re.findall(r"`([a-z_:][a-z0-9_:]*)`", panel.get("description", "").rpartition("Metric")[2]))
        assert listed <= exported | {n.removesuffix("_bucket") for n in exported}, panel["title"]
    # the panels the issue asks for
    for name in (
        "llamacpp:kv_cache_usage_ratio",
        "kvctl_kv_projected_ratio",
        "kvctl_parked_requests",
        "kvctl_parked_bytes",
        "kvctl_parks_total",
        "kvctl_resumes_total",
        "llamacpp:slot_auto_parks_total",
        "kvctl_park_duration_seconds_bucket",
        "kvctl_resume_duration_seconds_bucket",
        "kvctl_proxy_queued_requests",
        "kvctl_proxy_admission_wait_seconds_bucket",
        "kvctl_proxy_time_to_first_token_seconds_bucket",
        "llamacpp:tokens_predicted_total",
        "kvctl_upstream_up",
        "kvctl_host_available_bytes",
        "kvctl_gpu_memory_used_bytes",
    ):
        assert name in used, f"no panel shows {name}"


def llama_cpp_cache_sdist() -> Path | None:
    cache = os.environ.get("KVCTL_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvctl"
    )
    path = Path(os.environ.get("KVCTL_LLAMA_SDIST") or Path(cache) / "sdist" / "llama_cpp_python-0.3.36.tar.gz")
    return path if path.is_file() else None


def test_the_builtin_server_metrics_are_the_pinned_tree_s() -> None:
    sdist = llama_cpp_cache_sdist()
    if sdist is None:
        pytest.skip("the pinned llama.cpp sdist is not cached yet (scripts/build_llama.sh downloads it)")
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name.endswith("vendor/llama.cpp/tools/server/server-task.cpp"):
                f = tar.extractfile(member)
                assert f is not None
                source = f.read().decode()
                break
        else:
            pytest.fail(f"no tools/server/server-task.cpp in {sdist}")
    for name in LLAMA_CPP_BUILTIN:
        assert f'"{name.removeprefix("llamacpp:")}"' in source, f"{name} is not exported by the pinned tree"


# --- Prometheus ------------------------------------------------------------------------------


def test_alert_rules_query_only_exported_metrics() -> None:
    rules = yaml.safe_load((PROMETHEUS / "kvctl-alerts.yml").read_text())
    exported = exported_metric_names()
    alerts = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            unknown = promql_metric_names(rule["expr"]) - exported
            assert not unknown, f"alert {rule['alert']} queries {sorted(unknown)}, which nothing exports"
            alerts[rule["alert"]] = rule
    for name in (
        "KvctlUpstreamDown",
        "KvctlServerFailed",
        "KvctlPressureAboveHigh",
        "KvctlParkFailures",
        "KvctlParkedTooLong",
        "KvctlAdmissionRefused",
        "KvctlParkBudgetNearlyFull",
    ):
        assert name in alerts
    assert f">= {DEFAULTS.policy.high}" in alerts["KvctlPressureAboveHigh"]["expr"]
    assert f"{DEFAULTS.policy.snapshot_budget_mib} * 1048576" in alerts["KvctlParkBudgetNearlyFull"]["expr"]


def test_prometheus_scrapes_kvctl_and_the_server() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {name: [t for sc in job["static_configs"] for t in sc["targets"]] for name, job in jobs.items()}
    assert targets["kvctl"] == [DEFAULTS.admin.listen]
    assert targets["llama-server"] == [f"{DEFAULTS.upstream.url.host}:{SERVER_PORT}"]
    assert config["rule_files"] == ["kvctl-alerts.yml"]
    for job in jobs.values():
        assert any(r.get("target_label") == "replica" for r in job["relabel_configs"])


def test_promtool_checks_the_config_and_runs_the_rule_tests() -> None:
    promtool = require_tool("promtool", "prometheus")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "kvctl-alerts.yml"],
        ["test", "rules", "kvctl-alerts.test.yml"],
    ):
        proc = subprocess.run(
            [promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


# --- Grafana provisioning --------------------------------------------------------------------


def test_grafana_provisioning_files() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((prov / "datasources" / "kvctl-prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    (provider,) = yaml.safe_load((prov / "dashboards" / "kvctl.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


# --- Kubernetes ------------------------------------------------------------------------------


def k8s_documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_k8s_pod_runs_kvctl_as_the_server_s_sidecar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    docs = k8s_documents()
    assert set(docs) == {
        ("ConfigMap", "kvctl"),
        ("ConfigMap", "llama-server"),
        ("Deployment", "kvctl-llama"),
        ("Service", "kvctl-llama"),
    }
    deployment = docs[("Deployment", "kvctl-llama")]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"llama-server", "kvctl"}
    server, kvctl = containers["llama-server"], containers["kvctl"]

    argv = server["command"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert int(argv[argv.index("--port") + 1]) == SERVER_PORT
    assert {"-kvu", "--slots", "--metrics"} <= set(argv)
    assert "ports" not in server, "the server listens on loopback only"

    ports = {p["name"]: p["containerPort"] for p in kvctl["ports"]}
    assert ports == {"proxy": PROXY_PORT, "admin": ADMIN_PORT}
    assert kvctl["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": ADMIN_PORT}
    assert kvctl["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": ADMIN_PORT}
    for c in (server, kvctl):
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # one user for both containers (set once for the pod), so psutil may read the server
    assert "runAsUser" in pod["securityContext"]
    assert all("runAsUser" not in c["securityContext"] for c in (server, kvctl))

    service = docs[("Service", "kvctl-llama")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(PROXY_PORT, "proxy")]

    # the ConfigMap's settings are real settings, and kvctl starts with them
    config = docs[("ConfigMap", "kvctl")]["data"]
    assert all(isinstance(v, str) for v in config.values())
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in kvctl.get("env", [])}
    # required off loopback, and Secrets, not a ConfigMap
    assert env == {"KVCTL_ADMIN__TOKEN": "kvctl-admin", "KVCTL_PROXY__PEER_API_KEY": "kvctl-peer"}
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVCTL_ADMIN__TOKEN", "test-token")
    monkeypatch.setenv("KVCTL_PROXY__PEER_API_KEY", "test-peer-key")
    keys_file = Path(config["KVCTL_PROXY__API_KEYS_FILE"])
    (tmp_path / "keys").write_text("sk-test test\n")  # the Secret's file, here
    monkeypatch.setenv("KVCTL_PROXY__API_KEYS_FILE", str(tmp_path / "keys"))
    settings = load_settings()
    assert split_host_port(settings.proxy.listen)[1] == PROXY_PORT
    assert split_host_port(settings.admin.listen)[1] == ADMIN_PORT
    assert settings.upstream.url.port == SERVER_PORT
    server_env = docs[("ConfigMap", "llama-server")]["data"]
    assert int(server_env["LLAMA_ARG_PARK_RAM"]) == settings.policy.snapshot_budget_mib

    # the proxy on 0.0.0.0 lets no one in without a key: kvctl's keys come from a mounted Secret
    mounts = {m["mountPath"]: m["name"] for m in kvctl["volumeMounts"]}
    volume = mounts[str(keys_file.parent)]
    assert next(v for v in pod["volumes"] if v["name"] == volume)["secret"]["secretName"] == "kvctl-api-keys"
    # the shutdown fits: kvctl drains, then stops; the server outlives the drain (preStop sleep)
    drain, stop = settings.proxy.drain_s, settings.supervisor.stop_timeout_s
    assert pod["terminationGracePeriodSeconds"] >= drain + DRAIN_GRACE_S + stop
    assert server["lifecycle"]["preStop"]["sleep"]["seconds"] >= drain + DRAIN_GRACE_S
    # before that, the requests move to the other replicas, found through the Service (ready pods only)
    assert kvctl["lifecycle"]["preStop"]["exec"]["command"][:2] == ["kvctl", "drain"]
    (peer,) = settings.proxy.drain_peers
    assert (peer.host, peer.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])


def test_k8s_manifest_matches_the_kubernetes_schemas() -> None:
    if shutil.which("kubeconform"):
        cmd = ["kubeconform", "-strict", "-summary", str(K8S)]
    elif shutil.which("kubernetes-validate"):
        cmd = ["kubernetes-validate", "--strict", "-k", K8S_MIN_VERSION, str(K8S)]
    else:
        # the same validator through its Python API (a test dependency), when its script is not on PATH
        kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
        for doc in k8s_documents().values():
            kubernetes_validate.validate(doc, K8S_MIN_VERSION, strict=True)
        return
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
