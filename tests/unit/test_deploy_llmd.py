"""deploy/k8s/llm-d/: llama-server + kvctl pods routed by llm-d's endpoint picker through an InferencePool.

Every document validates: the built-in kinds with kubernetes-validate (strict, against the oldest Kubernetes the
manifests support), the InferencePool and the HTTPRoute with jsonschema against the schemas kept in
deploy/k8s/schemas/, and the endpoint picker's configs (files in a ConfigMap) against the EndpointPickerConfig
schema there. Then what ties the documents to kvctl: the engine config names exactly the gauges kvctl serves, the
zero-configuration variant serves the names the stock picker reads, the pool selects the Deployment's pods on
kvctl's proxy port, the picker's thresholds sit at kvctl's LOW below HIGH, and kvctl starts with the settings.
No network: the validators' schemas are files. A missing validator skips, and fails under CI (require_module).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.proxy.app import DRAIN_GRACE_S
from controller.proxy.endpoint_metrics import CACHE_INFO_LABELS, KVCTL_NAMES, VLLM_NAMES
from controller.settings import MetricsCompat, Settings, load_settings, split_host_port
from tests.harness import K8S_MIN_VERSION, require_module

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
LLMD = K8S / "llm-d"
SCHEMAS = K8S / "schemas"
SIDECAR = K8S / "kvctl-sidecar.yaml"
KVCTL_VARIANT = LLMD / "kvctl-llama.yaml"
VLLM_VARIANT = LLMD / "kvctl-llama-vllm-names.yaml"
PICKER = LLMD / "endpoint-picker.yaml"
POOL = LLMD / "inferencepool.yaml"

CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json",
}
PICKER_SCHEMA = "endpointpickerconfig.json"

# The picker's engine label and its built-in `vllm` engine config, which reads pods without the label:
# llm-d/llm-d-router pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go (defaultEngineConfigs,
# defaultEngineName = "vllm"; commit 08cbacc83054c7dfbea810f1d9518e5c22632d60) and extractor.go (the label
# names block_size and num_gpu_blocks when cacheBlockSizeLabelName / cacheNumBlocksLabelName are unset).
ENGINE_LABEL = "llm-d.ai/engine-type"
STOCK_DEFAULT_ENGINE = "vllm"
STOCK_VLLM_ENGINE = {
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "cacheInfoSpec": "vllm:cache_config_info",
}
STOCK_CACHE_LABELS = ("block_size", "num_gpu_blocks")
# which protocol metric each engine config field reads
SPEC_FIELDS = {
    "queued": "queuedRequestsSpec",
    "running": "runningRequestsSpec",
    "kv_usage": "kvUsageSpec",
    "cache_info": "cacheInfoSpec",
}
KVCTL_ENGINE = "llamacpp-kvctl"

DEFAULTS = Settings()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVCTL_"):
            monkeypatch.delenv(key)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in documents(path)}


ALL_DOCUMENTS = [(path.name, doc) for path in sorted(LLMD.glob("*.yaml")) for doc in documents(path)]


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    return loaded


def errors(schema_name: str, instance: Any) -> list[str]:
    jsonschema = require_module("jsonschema", "jsonschema")
    validator = jsonschema.Draft202012Validator(schema(schema_name))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(instance)]


def picker_configs() -> dict[str, dict[str, Any]]:
    """The EndpointPickerConfig files in the picker's ConfigMap, by file name."""
    data = by_kind(PICKER)[("ConfigMap", "kvctl-llama-epp")]["data"]
    return {name: yaml.safe_load(text) for name, text in data.items()}


def plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def flag(args: list[str], name: str) -> str:
    """The value of `--name value` or `--name=value` in a container's args."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    raise AssertionError(f"{name} is not in {args}")


def gateway_duration_s(text: str) -> float:
    """A Gateway API Duration (GEP-2257: 1h, 30m, 10s, 500ms, combined) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, text
    return sum(int(n) * units[u] for n, u in parts)


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in SCHEMAS.glob("*.json")))
def test_the_schemas_are_json_schemas_that_name_their_source(name: str) -> None:
    jsonschema = require_module("jsonschema", "jsonschema")
    s = schema(name)
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert re.search(r"commit [0-9a-f]{40}", s["$comment"]), f"{name}: $comment must name its source and commit"


def test_every_kind_has_a_schema() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for _, d in ALL_DOCUMENTS}
    custom = {k for k in kinds if not k[0].startswith(("v1", "apps/", "rbac.authorization.k8s.io/"))}
    assert custom == set(CRD_SCHEMAS), "a custom resource without a schema in deploy/k8s/schemas/"
    assert {p.name for p in SCHEMAS.glob("*.json")} == {*CRD_SCHEMAS.values(), PICKER_SCHEMA}


@pytest.mark.parametrize(
    "doc", [d for _, d in ALL_DOCUMENTS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in ALL_DOCUMENTS]
)
def test_every_document_validates(doc: dict[str, Any]) -> None:
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        assert errors(crd, doc) == []
        return
    kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
    try:
        kubernetes_validate.validate(doc, K8S_MIN_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("name", ["kvctl-names.yaml", "stock.yaml"])
def test_the_picker_configs_validate(name: str) -> None:
    assert errors(PICKER_SCHEMA, picker_configs()[name]) == []


def test_the_schemas_reject_what_the_picker_and_the_api_server_reject() -> None:
    """Strict where the real readers are: a misspelt field, a value out of range, a broken CEL rule."""
    config = picker_configs()["kvctl-names.yaml"]
    bad = copy.deepcopy(config)
    engine = plugin(bad, "core-metrics-extractor")["parameters"]["engineConfigs"][0]
    engine["kvUsageSpecs"] = engine.pop("kvUsageSpec")
    assert errors(PICKER_SCHEMA, bad), "an unknown engine config field is an error to the picker's strict decoder"
    bad = copy.deepcopy(config)
    plugin(bad, "utilization-detector")["parameters"]["kvCacheUtilThreshold"] = 80
    assert errors(PICKER_SCHEMA, bad), "kvCacheUtilThreshold is a fraction in (0, 1]"
    bad = copy.deepcopy(config)
    bad["schedulingProfile"] = bad.pop("schedulingProfiles")
    assert errors(PICKER_SCHEMA, bad)

    pool = by_kind(POOL)[("InferencePool", "kvctl-llama")]
    bad = copy.deepcopy(pool)
    del bad["spec"]["endpointPickerRef"]["port"]
    assert errors("inferencepool.json", bad), "port is required when kind is 'Service' (the default)"
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPortNumber"] = bad["spec"].pop("targetPorts")[0]["number"]
    assert errors("inferencepool.json", bad), "targetPortNumber is the pre-v1 field"

    route = by_kind(POOL)[("HTTPRoute", "kvctl-llama")]
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["backendRefs"] = [{"name": "kvctl-llama"}]
    assert errors("httproute.json", bad), "a Service backendRef needs a port"
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeouts"]["request"] = "1 hour"
    assert errors("httproute.json", bad)


# --- what the picker reads -------------------------------------------------------------------


def test_the_engine_config_names_exactly_the_gauges_kvctl_serves() -> None:
    params = plugin(picker_configs()["kvctl-names.yaml"], "core-metrics-extractor")["parameters"]
    assert params.get("engineLabelKey", ENGINE_LABEL) == ENGINE_LABEL
    # vLLM pods (unlabelled) may share the pool: the default engine stays the built-in one
    assert params.get("defaultEngine", STOCK_DEFAULT_ENGINE) == STOCK_DEFAULT_ENGINE
    (engine,) = params["engineConfigs"]
    assert engine["name"] == KVCTL_ENGINE
    assert {k: engine[field] for k, field in SPEC_FIELDS.items()} == KVCTL_NAMES
    assert (engine["cacheBlockSizeLabelName"], engine["cacheNumBlocksLabelName"]) == CACHE_INFO_LABELS
    assert set(engine) == {"name", *SPEC_FIELDS.values(), "cacheBlockSizeLabelName", "cacheNumBlocksLabelName"}
    # the pod label selects it
    pods = by_kind(KVCTL_VARIANT)[("Deployment", "kvctl-llama")]["spec"]["template"]["metadata"]["labels"]
    assert pods[ENGINE_LABEL] == KVCTL_ENGINE


def test_the_zero_configuration_variant_serves_what_the_stock_picker_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = by_kind(VLLM_VARIANT)
    pods = docs[("Deployment", "kvctl-llama")]["spec"]["template"]["metadata"]["labels"]
    assert pods.get(ENGINE_LABEL, STOCK_DEFAULT_ENGINE) == STOCK_DEFAULT_ENGINE
    config = docs[("ConfigMap", "kvctl")]["data"]
    assert config["KVCTL_PROXY__METRICS_COMPAT"] == "vllm"
    assert kvctl_settings(config, monkeypatch, tmp_path).proxy.metrics_compat is MetricsCompat.VLLM
    assert {k: STOCK_VLLM_ENGINE[field] for k, field in SPEC_FIELDS.items()} == VLLM_NAMES
    assert STOCK_CACHE_LABELS == CACHE_INFO_LABELS
    # stock.yaml is the stock picker: no engine config of its own, nothing kvctl-specific
    stock = picker_configs()["stock.yaml"]
    assert "parameters" not in plugin(stock, "core-metrics-extractor")
    assert "kvctl" not in json.dumps(stock)


def test_the_two_variants_differ_only_in_the_engine_label() -> None:
    kvctl_names, vllm_names = by_kind(KVCTL_VARIANT), by_kind(VLLM_VARIANT)
    # both serve both name sets: a stock picker reads either, the engine config reads kvctl's
    assert kvctl_names[("ConfigMap", "kvctl")]["data"]["KVCTL_PROXY__METRICS_COMPAT"] == "vllm"
    for docs in (kvctl_names, vllm_names):
        docs[("Deployment", "kvctl-llama")]["spec"]["template"]["metadata"]["labels"].pop(ENGINE_LABEL, None)
    assert kvctl_names == vllm_names


def test_the_pods_are_the_sidecar_manifest_s_pods() -> None:
    """The pod, its server's settings and kvctl's settings are deploy/k8s/kvctl-sidecar.yaml's (tested there)."""
    sidecar, llmd = by_kind(SIDECAR), by_kind(KVCTL_VARIANT)
    ours, theirs = llmd[("Deployment", "kvctl-llama")]["spec"], sidecar[("Deployment", "kvctl-llama")]["spec"]
    assert ours["template"]["spec"] == theirs["template"]["spec"]
    assert ours["selector"] == theirs["selector"] and ours["strategy"] == theirs["strategy"]
    assert ours["replicas"] >= 2
    assert llmd[("ConfigMap", "llama-server")]["data"] == sidecar[("ConfigMap", "llama-server")]["data"]
    assert llmd[("ConfigMap", "kvctl")]["data"] == sidecar[("ConfigMap", "kvctl")]["data"]


# --- pool, picker, route ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", [KVCTL_VARIANT, VLLM_VARIANT], ids=lambda p: p.name)
def test_the_pool_selects_the_deployment_s_pods_on_kvctl_s_proxy_port(variant: Path) -> None:
    deployment = by_kind(variant)[("Deployment", "kvctl-llama")]
    pool = by_kind(POOL)[("InferencePool", "kvctl-llama")]["spec"]
    selector = pool["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    kvctl = containers(deployment)["kvctl"]
    ports = {p["name"]: p["containerPort"] for p in kvctl["ports"]}
    proxy_port = split_host_port(DEFAULTS.proxy.listen)[1]
    assert pool["targetPorts"] == [{"number": ports["proxy"]}] and ports["proxy"] == proxy_port
    # only Ready pods are routed to: readiness is kvctl's, liveness only its event loop
    assert kvctl["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": ports["admin"]}
    assert kvctl["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": ports["admin"]}


def test_the_picker_serves_the_pool() -> None:
    docs = by_kind(PICKER)
    pool = by_kind(POOL)[("InferencePool", "kvctl-llama")]
    deployment = docs[("Deployment", "kvctl-llama-epp")]
    epp = containers(deployment)["epp"]
    assert flag(epp["args"], "--pool-name") == pool["metadata"]["name"]
    assert flag(epp["args"], "--pool-group") == pool["apiVersion"].split("/")[0]
    # the config file is one of the ConfigMap's, mounted where --config-file looks
    config_file = Path(flag(epp["args"], "--config-file"))
    mounts = {m["mountPath"]: m["name"] for m in epp["volumeMounts"]}
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts["/config"])
    assert str(config_file.parent) == "/config" and volume["configMap"]["name"] == "kvctl-llama-epp"
    assert config_file.name == "kvctl-names.yaml" and config_file.name in picker_configs()
    # the pool's picker is this Service's ext_proc port
    ref = pool["spec"]["endpointPickerRef"]
    service = docs[("Service", ref["name"])]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert {p["name"]: p["containerPort"] for p in epp["ports"]}[port["targetPort"]] == 9002
    # it may watch the pool and its pods
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = docs[("RoleBinding", "kvctl-llama-epp")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    rules = docs[("Role", binding["roleRef"]["name"])]["rules"]
    watched = [rule for rule in rules if "watch" in rule["verbs"]]
    allowed = {(group, resource) for rule in watched for group in rule["apiGroups"] for resource in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= allowed


def test_the_route_sends_to_the_pool() -> None:
    docs = by_kind(POOL)
    (rule,) = docs[("HTTPRoute", "kvctl-llama")]["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvctl-llama"}
    ]
    # a request may wait its whole admission timeout before it streams
    assert gateway_duration_s(rule["timeouts"]["request"]) > DEFAULTS.proxy.queue_timeout_s


def test_the_picker_moves_new_requests_away_before_kvctl_parks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = picker_configs()["kvctl-names.yaml"]
    detector = plugin(config, "utilization-detector")["parameters"]
    settings = kvctl_settings(by_kind(KVCTL_VARIANT)[("ConfigMap", "kvctl")]["data"], monkeypatch, tmp_path)
    # the picker's line is kvctl's LOW (usage is kvctl's projected occupancy), below HIGH where kvctl parks
    assert detector["kvCacheUtilThreshold"] == settings.policy.low < settings.policy.high
    assert detector["headroom"] == 0  # the filter's limit is the threshold itself
    assert detector["queueDepthThreshold"] == 5
    # as a filter in the scheduling profile, not only the pool's saturation signal
    (profile,) = config["schedulingProfiles"]
    assert profile["plugins"][0] == {"pluginRef": "utilization-detector"}


# --- kvctl's settings ------------------------------------------------------------------------


def kvctl_settings(config: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Settings:
    """kvctl's settings from its ConfigMap, with the Secret-backed ones set as the pod sets them."""
    assert all(isinstance(v, str) for v in config.values())
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVCTL_ADMIN__TOKEN", "test-token")
    (tmp_path / "keys").write_text("sk-test test\n")
    monkeypatch.setenv("KVCTL_PROXY__API_KEYS_FILE", str(tmp_path / "keys"))
    return load_settings()


@pytest.mark.parametrize("variant", [KVCTL_VARIANT, VLLM_VARIANT], ids=lambda p: p.name)
def test_kvctl_starts_with_the_config_map_s_settings(
    variant: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = by_kind(variant)
    settings = kvctl_settings(docs[("ConfigMap", "kvctl")]["data"], monkeypatch, tmp_path)
    deployment = docs[("Deployment", "kvctl-llama")]
    ports = {p["name"]: p["containerPort"] for p in containers(deployment)["kvctl"]["ports"]}
    assert split_host_port(settings.proxy.listen) == ("0.0.0.0", ports["proxy"])
    assert split_host_port(settings.admin.listen)[1] == ports["admin"]
    assert settings.upstream.url.port == DEFAULTS.upstream.url.port
    server_env = docs[("ConfigMap", "llama-server")]["data"]
    assert int(server_env["LLAMA_ARG_PARK_RAM"]) == settings.policy.snapshot_budget_mib
    pod = deployment["spec"]["template"]["spec"]
    stop = settings.proxy.drain_s + DRAIN_GRACE_S + settings.supervisor.stop_timeout_s
    assert pod["terminationGracePeriodSeconds"] >= stop
