"""deploy/k8s: every kustomization renders with `kubectl kustomize` and validates, and what the
manifests say about atomrt matches the code.

- Core kinds validate with `kubernetes-validate` (Kubernetes' own schemas, strict: unknown fields
  fail) for the oldest and newest Kubernetes we target; KubeRay kinds validate with `jsonschema`
  against the `openAPIV3Schema` of KubeRay's CRDs (tests/k8s_crds/, unchanged), made strict the way
  the API server's strict field validation is: an object schema that lists its properties admits
  no others. Each validator is shown to reject broken manifests.
- Against the code: the image is the package's version, the config file builds a `Config`, every
  `atomrt` command line parses with the CLI's own parser (`build_parser()`), the prewarm's config
  compiles something, ports, probes and grace periods agree with the flags, every `ATOMRT_*`
  variable is one runtime/envs.py declares, and the Ray Serve / runtime env copies match
  deploy/ray/.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from atomrt.runtime.config import ParallelConfig
from atomrt.runtime.entrypoints.cli import build_parser
from atomrt.runtime.entrypoints.config_args import config_from_args
from atomrt.runtime.entrypoints.prewarm import check_prewarm_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
CRDS = Path(__file__).with_name("k8s_crds")
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes we target, and the newest schema
CONFIG_PATH = "/etc/atomrt/atomrt.yaml"  # where pods mount the ConfigMap's file
SERVE_APP = "atomrt.runtime.entrypoints.serve_app:app"
# a route in the server's source: @app.get("/health"), router.add_api_route("/ready", ...), ...
ROUTE = r"""(?:\.get|\.post|\.route|add_api_route)\(\s*["'](/[\w/.-]*)["']"""


def kustomizations() -> list[Path]:
    """Every directory under deploy/k8s with a kustomization (Components render only in overlays)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent)
    return found


@functools.cache
def render(directory: Path) -> tuple[dict, ...]:
    proc = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory}: {proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def all_docs() -> Iterator[tuple[Path, dict]]:
    for directory in kustomizations():
        for doc in render(directory):
            yield directory, doc


def _strict(schema: Any) -> Any:
    """A copy where every object schema that lists its properties admits no others (what the API
    server's strict field validation does with a CRD's structural schema)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.Validator:
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict) -> None:
    """Raise if `doc` is not a valid manifest of its kind."""
    if doc["kind"] in CRD_FILES:
        assert doc["apiVersion"] == "ray.io/v1", doc["apiVersion"]
        crd_validator(doc["kind"]).validate(doc)
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
            K8S_VERSIONS[-1],
            strict=True,
        )  # the object metadata, which the CRD schema leaves open
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


# ---- rendering and validation -----------------------------------------------------------------


def test_every_kustomization_renders_and_validates():
    dirs = kustomizations()
    names = {str(d.relative_to(K8S)) for d in dirs}
    assert {"base", "plain", "kuberay/cluster", "kuberay/prewarm", "kuberay/serve"} <= names
    assert {"kuberay/bench-dp", "overlays/plain-h200", "overlays/kuberay-serve-h200"} <= names
    kinds = set()
    for directory, doc in all_docs():
        try:
            validate(doc)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            pytest.fail(
                f"{directory.relative_to(REPO)}: {doc['kind']}/{doc['metadata']['name']}: {e}"
            )
        kinds.add(doc["kind"])
    assert kinds >= {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job"}
    assert kinds >= {"Namespace", "RayCluster", "RayJob", "RayService"}


def _one(directory: str, kind: str, name: str = "") -> dict:
    docs = [
        d
        for d in render(K8S / directory)
        if d["kind"] == kind and (not name or d["metadata"]["name"] == name)
    ]
    assert len(docs) == 1, f"{directory}: {len(docs)} {kind} {name}"
    return copy.deepcopy(docs[0])


@pytest.mark.parametrize(
    "mutate, what",
    [
        (lambda d: d["spec"].update(replica=2), "an unknown field"),
        (lambda d: d["spec"].update(replicas="two"), "a wrong type"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagee="x"), "a typo"),
        (lambda d: d["spec"].pop("selector"), "a missing required field"),
    ],
)
def test_core_validator_rejects_a_broken_manifest(mutate, what):
    doc = _one("plain", "Deployment")
    validate(doc)
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)


@pytest.mark.parametrize(
    "kind, directory, mutate",
    [
        ("RayCluster", "kuberay/cluster", lambda d: d["spec"].update(workerGroupSpec=[])),
        ("RayCluster", "kuberay/cluster", lambda d: d["spec"].pop("headGroupSpec")),
        (
            "RayCluster",
            "kuberay/cluster",
            lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="two"),
        ),
        (
            "RayCluster",
            "kuberay/cluster",
            lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
                imagee="x"
            ),
        ),
        ("RayJob", "kuberay/prewarm", lambda d: d["spec"].update(entrypoint=["atomrt"])),
        ("RayService", "kuberay/serve", lambda d: d["spec"].pop("rayClusterConfig")),
        ("RayService", "kuberay/serve", lambda d: d["spec"]["rayClusterConfig"].update(x=1)),
    ],
)
def test_crd_validator_rejects_a_broken_manifest(kind, directory, mutate):
    doc = _one(directory, kind)
    validate(doc)
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


# ---- pod templates ----------------------------------------------------------------------------


def pod_specs(doc: dict) -> Iterator[tuple[str, dict]]:
    """(role, pod spec) of every pod template in a manifest."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "Job"):
        yield doc["kind"], spec["template"]["spec"]
    cluster = spec.get("rayClusterConfig") if doc["kind"] == "RayService" else spec
    if doc["kind"] in ("RayCluster", "RayService"):
        yield f"{doc['kind']} head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs", []):
            yield f"{doc['kind']} {group['groupName']}", group["template"]["spec"]


def _gpus(container: dict) -> tuple[str, str]:
    res = container.get("resources", {})
    return (
        res.get("requests", {}).get("nvidia.com/gpu", "0"),
        res.get("limits", {}).get("nvidia.com/gpu", "0"),
    )


def _env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _mounts(pod: dict, container: dict) -> dict[str, tuple[dict, dict]]:
    """mount path -> (volume, volume mount)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: (volumes[m["name"]], m) for m in container.get("volumeMounts", [])}


def test_pod_templates_hold_gpus_shm_cache_and_interfaces():
    seen = set()
    serving = ("Deployment", "RayService gpu", "RayService head")
    for directory, doc in all_docs():
        for role, pod in pod_specs(doc):
            (container,) = pod["containers"]
            seen.add(role)
            where = f"{directory.relative_to(K8S)} {role}"
            requests, limits = _gpus(container)
            assert requests == limits, f"{where}: GPU requests {requests} != limits {limits}"
            mounts, env = _mounts(pod, container), _env(container)
            cache_volume, cache_mount = mounts["/mnt/atomrt-cache"]
            assert cache_volume["persistentVolumeClaim"]["claimName"] == "atomrt-compile-cache"
            assert env["ATOMRT_CACHE_ROOT"] == "/mnt/atomrt-cache", where
            read_only = role in serving
            assert bool(cache_mount.get("readOnly")) == read_only, f"{where}: cache mount"
            assert bool(cache_volume["persistentVolumeClaim"].get("readOnly")) == read_only
            assert (env.get("ATOMRT_COMPILE_CACHE_READ_ONLY") == "1") == read_only, where
            assert mounts[CONFIG_PATH.rsplit("/", 1)[0]][0]["configMap"]["name"] == "atomrt-config"
            assert mounts["/mnt/models"][1].get("readOnly") is True
            if role.endswith("head"):
                assert requests == "0", f"{where}: the head holds no GPU"
                params = _ray_start_params(doc, role)
                assert params["num-gpus"] == "0" and params["num-cpus"] == "0", where
                continue
            assert int(requests) >= 1, f"{where}: no GPU"
            shm_volume, _ = mounts["/dev/shm"]
            assert shm_volume["emptyDir"]["medium"] == "Memory", where
            assert _gib(shm_volume["emptyDir"]["sizeLimit"]) >= 8, where
            if role.startswith("Ray"):  # ranks on several pods: NCCL, Gloo and tcp:// addresses
                assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0", where
                assert env["ATOMRT_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert seen >= {"Deployment", "Job", "RayCluster head", "RayCluster gpu", "RayService gpu"}


def _ray_start_params(doc: dict, role: str) -> dict:
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    return cluster["headGroupSpec"]["rayStartParams"]


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()
    return int(number) / (1024 if unit == "Mi" else 1)


def test_every_reference_resolves_within_its_kustomization():
    for directory in kustomizations():
        docs = render(directory)
        have = {(d["kind"], d["metadata"]["name"]) for d in docs}
        for doc in docs:
            for role, pod in pod_specs(doc):
                for volume in pod.get("volumes", []):
                    if "configMap" in volume:
                        assert ("ConfigMap", volume["configMap"]["name"]) in have, (directory, role)
                    if "persistentVolumeClaim" in volume:
                        claim = volume["persistentVolumeClaim"]["claimName"]
                        assert ("PersistentVolumeClaim", claim) in have, (directory, role)
            selector = doc.get("spec", {}).get("clusterSelector", {}).get("ray.io/cluster")
            if selector:
                assert ("RayCluster", selector) in have, f"{directory}: RayJob selects {selector}"


# ---- against the code -------------------------------------------------------------------------


def test_images_are_the_package_version():
    image = f"atomrt:{importlib.metadata.version('atomrt')}"
    images = set()
    for _, doc in all_docs():
        for _, pod in pod_specs(doc):
            images |= {c["image"] for c in pod["containers"]}
    assert images == {image}  # what deploy/Dockerfile builds (tests/test_dockerfile.py)


def test_config_file_builds_a_config_that_compiles():
    from atomrt.runtime.config_io import build_config

    config = build_config(str(K8S / "base" / "atomrt.yaml"))
    check_prewarm_config(config)
    rendered = _one("base", "ConfigMap", "atomrt-config")["data"]["atomrt.yaml"]
    assert rendered == (K8S / "base" / "atomrt.yaml").read_text()


def commands() -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every `atomrt` command line in the manifests."""
    for directory, doc in all_docs():
        where = f"{directory.relative_to(K8S)} {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "RayJob":
            yield where, shlex.split(doc["spec"]["entrypoint"])
        for _, pod in pod_specs(doc):
            for container in pod["containers"]:
                argv = container.get("command", []) + container.get("args", [])
                if argv:
                    yield where, argv


def _parse(argv: list[str]):
    assert argv[0] == "atomrt", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"the atomrt CLI refuses {shlex.join(argv)}")


def test_generate_and_prewarm_command_lines_parse_and_prewarm_compiles():
    parsed = 0
    for where, argv in commands():
        if argv[1] not in ("generate", "prewarm"):
            continue
        args = _parse(argv)
        assert args.config == CONFIG_PATH, where
        args.config = str(K8S / "base" / "atomrt.yaml")
        config = config_from_args(args)
        if args.command == "prewarm":
            check_prewarm_config(config)
        parsed += 1
    assert parsed >= 3  # the plain Job, the RayJob, and their overlays


def test_bench_dp_command_lines_parse():
    """The benchmark's own flags too: a flag `atomrt bench dp` does not take fails here."""
    from atomrt.runtime.bench.dp import _parse as parse_bench_dp

    argv = [a for _, a in commands() if a[1] == "bench"]
    assert argv
    for a in argv:
        args, rest = build_parser().parse_known_args(a[1:])
        assert args.what == "dp"
        try:
            bench = parse_bench_dp(rest)
        except SystemExit:
            pytest.fail(f"atomrt bench dp refuses {shlex.join(a)}")
        assert bench.executor == "ray" and bench.layouts  # the ranks go over the cluster


def _serve_commands() -> list[tuple[str, list[str]]]:
    return [(where, argv) for where, argv in commands() if argv[1] == "serve"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_serve_command_lines_and_probes_match_the_server():
    serve = _serve_commands()
    assert serve
    for where, argv in serve:
        args = _parse(argv)
        assert args.port == int(_flag(argv, "--port")) and args.shutdown_timeout == 30, where
    routes = set()
    for source in (REPO / "runtime" / "entrypoints").rglob("*.py"):
        routes |= set(re.findall(ROUTE, source.read_text()))
    for path in ("/health", "/ready", "/metrics", "/version", "/v1/models"):
        assert path in routes, f"the server has no route {path}"
    app_module = SERVE_APP.split(":")[0].replace("atomrt.runtime.", "runtime/").replace(".", "/")
    assert (REPO / f"{app_module}.py").is_file()


def test_ports_probes_and_grace_periods_agree():
    compile_timeout = ParallelConfig().compile_timeout_s
    serve = dict(_serve_commands())
    checked = 0
    for directory, doc in all_docs():
        for role, pod in pod_specs(doc):
            (container,) = pod["containers"]
            ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in container:
                    assert container[kind]["httpGet"]["port"] in ports, (directory, role, kind)
            if "startupProbe" not in container:
                continue
            checked += 1
            where = f"{directory.relative_to(K8S)} {role}"
            probe = container["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] >= compile_timeout, where
            assert container["startupProbe"]["httpGet"]["path"] == "/health", where
            assert container["livenessProbe"]["httpGet"]["path"] == "/health", where
            assert container["readinessProbe"]["httpGet"]["path"] == "/ready", where
            grace = pod["terminationGracePeriodSeconds"]
            if doc["kind"] == "Deployment":
                argv = serve[f"{directory.relative_to(K8S)} Deployment/{doc['metadata']['name']}"]
                assert ports["http"] == int(_flag(argv, "--port")), where
                assert grace > int(_flag(argv, "--shutdown-timeout")), where
            else:  # a Serve proxy on every worker: the app's port, the server's default timeout
                serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
                assert ports["serve"] == serve_config["http_options"]["port"], where
                assert grace > 30, where
    assert checked >= 4
    service = _one("plain", "Service")
    deployment = _one("plain", "Deployment")
    (port,) = service["spec"]["ports"]
    names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in names and port["port"] == 8000
    selector = service["spec"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_env_names_are_declared_and_ray_copies_match_deploy_ray():
    declared = set(re.findall(r"ATOMRT_[A-Z_]+", (REPO / "runtime" / "envs.py").read_text()))
    declared |= {"ATOMRT_API_KEY"}  # the server's, read by `atomrt serve`
    for directory, doc in all_docs():
        text = yaml.safe_dump(doc)
        unknown = set(re.findall(r"ATOMRT_[A-Z_]+", text)) - declared
        assert not unknown, f"{directory.relative_to(K8S)}: undeclared {unknown}"
    runtime_env = yaml.safe_load((REPO / "deploy" / "ray" / "runtime-env.yaml").read_text())
    for name in ("kuberay/prewarm", "kuberay/bench-dp"):
        job = _one(name, "RayJob")
        assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == runtime_env, name
    serve_config = yaml.safe_load((REPO / "deploy" / "ray" / "serve-config.yaml").read_text())
    service = _one("kuberay/serve", "RayService")
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == serve_config
    (app,) = serve_config["applications"]
    assert app["import_path"] == SERVE_APP
    env = app["runtime_env"]["env_vars"]
    assert env == {**runtime_env["env_vars"], "ATOMRT_COMPILE_CACHE_READ_ONLY": "1"}
