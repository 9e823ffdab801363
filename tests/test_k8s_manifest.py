"""examples/mpijob_pytorch_mnist.yaml, the Kubeflow MPIJob (v2beta1) for the CPU image, checked
without a cluster: against the MPI Operator's CRD schema (what `kubectl apply` validates, with
strict field validation: no unknown fields), and against the image and `hvdkit run` it names.
The run itself, as the operator runs it, is tests/test_docker_image.py's.

The CRD is the operator's (kubeflow/mpi-operator, manifests/base/kubeflow.org_mpijobs.yaml);
no package registry ships it, so the test reads a copy from ``$HVDKIT_MPIJOB_CRD`` or
``k8s/`` under hvdkit's cache (``~/.cache/hvdkit``, outside the clone, like the wheels) and is skipped,
saying so, where there is none.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import ROOT

from hvdkit.cli import build_parser
from hvdkit.horovod_build.config import default_cache_dir

yaml = pytest.importorskip("yaml")
MANIFEST = ROOT / "examples" / "mpijob_pytorch_mnist.yaml"
CACHE = default_cache_dir() / "k8s"


def job() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def crd_schema() -> dict:
    given = os.environ.get("HVDKIT_MPIJOB_CRD")
    copies = [Path(given)] if given else sorted(CACHE.glob("kubeflow.org_mpijobs*.yaml"))
    if not copies or not copies[-1].is_file():
        pytest.skip(
            "no copy of the MPI Operator's CRD (kubeflow.org_mpijobs.yaml from "
            f"kubeflow/mpi-operator) in $HVDKIT_MPIJOB_CRD or {CACHE}: no package registry "
            "ships it"
        )
    crd = yaml.safe_load(copies[-1].read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v2beta1"]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not declare: the API server prunes them, and `kubectl apply`'s
    strict field validation refuses them (a misspelt field would silently do nothing)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in schema["properties"]:
                found += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, f"{path}.{key}")
            elif not extra:
                found.append(f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def test_the_manifest_is_valid_against_the_operators_crd():
    jsonschema = pytest.importorskip("jsonschema")
    schema = crd_schema()
    validator = jsonschema.Draft4Validator(schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(job())]
    assert not errors, errors
    assert unknown_fields(job(), schema) == []
    # The checks can fail: a wrong type, and a misspelt field.
    broken = job()
    broken["spec"]["slotsPerWorker"] = "one"
    broken["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["comand"] = []
    assert any("slotsPerWorker" in ".".join(map(str, e.path)) for e in validator.iter_errors(broken))
    assert unknown_fields(broken, schema) == [
        ".spec.mpiReplicaSpecs.Worker.template.spec.containers[0].comand"
    ]


def test_the_manifest_matches_the_image_and_hvdkit_run():
    """What the CRD cannot know: the image's user, its sshd helper and port, and the launcher
    line being a valid `hvdkit run` whose script exists in the image."""
    spec = job()["spec"]
    dockerfile = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    uid = re.findall(r"^USER (\d+)$", dockerfile, re.M)[-1]
    assert re.search(rf"useradd .*--uid {uid} .*hvdkit", dockerfile)
    assert spec["sshAuthMountPath"] == "/home/hvdkit/.ssh"  # the image user's home
    port = re.search(r"^ARG SSH_PORT=(\d+)$", dockerfile, re.M).group(1)
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert spec["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1
    for pod in (launcher, worker):
        assert str(pod["securityContext"]["runAsUser"]) == uid
    (container,) = worker["containers"]
    assert container["command"] == ["start-sshd"]
    assert (ROOT / "docker" / "start-sshd").is_file()
    assert container["ports"][0]["containerPort"] == int(port)
    args = launcher["containers"][0]["args"]
    parsed = build_parser().parse_args(args)  # the image's entrypoint is `hvdkit`
    assert args[0] == "run" and parsed.func.__name__ == "run_command"
    assert str(parsed.ssh_port) == port
    assert not any(a in args for a in ("-np", "-H", "--hostfile"))  # the allocation decides
    script = args[args.index("--") + 2]
    assert (ROOT / script).is_file() and "COPY examples /opt/hvdkit/examples" in dockerfile
