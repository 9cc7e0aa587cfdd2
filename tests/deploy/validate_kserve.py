#!/usr/bin/python3
"""Offline check of deploy/kserve/: each manifest has the fields KServe's CRDs
require, with the types they define (ClusterServingRuntime
serving.kserve.io/v1alpha1, InferenceService serving.kserve.io/v1beta1), and no
field they do not know at the levels written here (a CRD drops unknown fields
silently, so a typo would otherwise pass). The schema below is our reading of
KServe's CRDs (config/crd/full/serving.kserve.io_clusterservingruntimes.yaml
and serving.kserve.io_inferenceservices.yaml), for the fields we use; the
container is a Kubernetes core/v1 Container, checked for its name, image,
args and ports. Also: the runtime's image serves what the manifests say (the
args are mha_server's flags, the probes its HTTP health routes).

    /usr/bin/python3 tests/deploy/validate_kserve.py deploy/kserve
"""

import os
import re
import sys

import yaml

STRING, BOOL, INT = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}
STRING_MAP = {"type": "object", "values": STRING}
PORT = {"type": "object", "required": ["containerPort"], "open": False,
        "properties": {"name": STRING, "containerPort": INT, "protocol": {"enum": ["TCP", "UDP",
                                                                                   "SCTP"]}}}
PROBE = {"type": "object", "open": True}
CONTAINER = {"type": "object", "required": ["name"], "open": True,
             "properties": {"name": STRING, "image": STRING, "args": {"type": "array",
                                                                      "items": STRING},
                            "ports": {"type": "array", "items": PORT},
                            "readinessProbe": PROBE, "livenessProbe": PROBE}}
METADATA = {"type": "object", "required": ["name"], "open": True,
            "properties": {"name": STRING, "annotations": STRING_MAP, "labels": STRING_MAP}}
# KServe's protocols (pkg/constants: v1, v2, grpc-v1, grpc-v2).
PROTOCOL = {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]}

SERVING_RUNTIME_SPEC = {
    "type": "object", "required": ["containers"], "open": False,
    "properties": {
        "annotations": STRING_MAP, "labels": STRING_MAP, "disabled": BOOL, "multiModel": BOOL,
        "protocolVersions": {"type": "array", "items": PROTOCOL},
        "supportedModelFormats": {"type": "array", "items": {
            "type": "object", "required": ["name"], "open": False,
            "properties": {"name": STRING, "version": STRING, "autoSelect": BOOL,
                           "priority": INT}}},
        "containers": {"type": "array", "items": CONTAINER},
    }}
MODEL_SPEC = {
    "type": "object", "required": ["modelFormat"], "open": False,
    "properties": {
        "modelFormat": {"type": "object", "required": ["name"], "open": False,
                        "properties": {"name": STRING, "version": STRING}},
        "runtime": STRING, "storageUri": STRING, "protocolVersion": PROTOCOL,
        "args": {"type": "array", "items": STRING}, "ports": {"type": "array", "items": PORT},
        "resources": {"type": "object", "open": True},
    }}
INFERENCE_SERVICE_SPEC = {
    "type": "object", "required": ["predictor"], "open": False,
    "properties": {"predictor": {
        "type": "object", "required": ["model"], "open": False,
        "properties": {"model": MODEL_SPEC, "minReplicas": INT, "maxReplicas": INT,
                       "timeout": INT}}}}
KINDS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): SERVING_RUNTIME_SPEC,
    ("serving.kserve.io/v1beta1", "InferenceService"): INFERENCE_SERVICE_SPEC,
}
TYPES = {"string": str, "boolean": bool, "integer": int, "object": dict, "array": list}


def check(value, schema, where):
    """The problems of `value` against `schema`, as messages."""
    problems = []
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{where}: {value!r} not in {schema['enum']}"]
    expected = TYPES[schema["type"]]
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        return [f"{where}: expected {schema['type']}, got {type(value).__name__}"]
    if schema["type"] == "array":
        for i, item in enumerate(value):
            problems += check(item, schema["items"], f"{where}[{i}]")
    if schema["type"] == "object":
        for name in schema.get("required", []):
            if name not in value:
                problems.append(f"{where}: missing required field {name}")
        for name, item in value.items():
            if "values" in schema:
                problems += check(item, schema["values"], f"{where}.{name}")
            elif name in schema.get("properties", {}):
                problems += check(item, schema["properties"][name], f"{where}.{name}")
            elif not schema.get("open", True):
                problems.append(f"{where}: unknown field {name}")
    return problems


def check_runtime_serves_it(doc, where):
    """The runtime's container: our image's flags and health routes."""
    problems = []
    container = doc["spec"]["containers"][0]
    if container["name"] != "kserve-container":
        problems.append(f"{where}: KServe merges the predictor into 'kserve-container'")
    args = dict(a.lstrip("-").split("=", 1) for a in container.get("args", []))
    if args.get("model_repository") != "/mnt/models":
        problems.append(f"{where}: the storage initializer writes /mnt/models")
    if args.get("http_port") != "8080":
        problems.append(f"{where}: KServe sends REST to 8080")
    with open(MAIN_CC) as f:
        flags = set(re.findall(r"ABSL_FLAG\([^,]+,\s*(\w+),", f.read()))
    for name in args:
        if name not in flags:
            problems.append(f"{where}: mha_server has no flag --{name}")
    for probe in ("readinessProbe", "livenessProbe"):
        path = container.get(probe, {}).get("httpGet", {}).get("path", "")
        if path not in ("/v2/health/ready", "/v2/health/live"):
            problems.append(f"{where}: {probe} should ask a v2 health route, not {path!r}")
    if {"v2", "grpc-v2"} - set(doc["spec"].get("protocolVersions", [])):
        problems.append(f"{where}: the server speaks v2 and grpc-v2")
    return problems


MAIN_CC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "server",
                       "main.cc")


def main(folder):
    problems, checked = [], 0
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(folder, name)) as f:
            for doc in yaml.safe_load_all(f):
                key = (doc.get("apiVersion"), doc.get("kind"))
                if key not in KINDS:
                    problems.append(f"{name}: unexpected {key}")
                    continue
                where = f"{name} ({doc['kind']})"
                found = check(doc.get("metadata"), METADATA, f"{where} metadata")
                found += check(doc.get("spec"), KINDS[key], f"{where} spec")
                if doc["kind"] == "ClusterServingRuntime" and not found:
                    found += check_runtime_serves_it(doc, where)
                problems += found
                checked += 1
                print(f"ok   {name}: {key[0]} {key[1]} {doc['metadata']['name']}")
    if checked == 0:
        problems.append("no manifest checked")
    for p in problems:
        print("FAIL", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
