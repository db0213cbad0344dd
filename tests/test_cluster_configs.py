"""The shipped cluster configs: the launcher YAML against the schema that ships with Ray, KubeRay keys."""

from __future__ import annotations

import json
import os

import jsonschema
import ray
import yaml

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "cluster")


def load(name):
    with open(os.path.join(CLUSTER, name)) as f:
        return yaml.safe_load(f)


def test_launcher_yaml_validates_against_rays_schema_and_matches_the_elastic_range():
    schema_path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    cfg = load("ray-cluster-aws.yaml")
    jsonschema.validate(cfg, schema)
    worker = cfg["available_node_types"]["cpu_worker"]
    assert (worker["min_workers"], worker["max_workers"]) == (1, 4)
    assert cfg["max_workers"] >= worker["max_workers"]
    assert cfg["head_node_type"] in cfg["available_node_types"]


def _check_cluster_spec(spec):
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"].startswith("rayproject/ray:")
    (group,) = spec["workerGroupSpecs"]
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "memory" in limits and "cpu" in limits


def test_kuberay_raycluster_manifest():
    m = load("kuberay-raycluster.yaml")
    assert (m["apiVersion"], m["kind"]) == ("ray.io/v1", "RayCluster")
    _check_cluster_spec(m["spec"])


def test_kuberay_rayjob_runs_the_example_on_its_own_cluster():
    m = load("kuberay-rayjob.yaml")
    assert (m["apiVersion"], m["kind"]) == ("ray.io/v1", "RayJob")
    assert m["spec"]["entrypoint"].startswith("python examples/train.py")
    assert "--workers 1,4" in m["spec"]["entrypoint"]
    assert m["spec"]["shutdownAfterJobFinishes"] is True
    _check_cluster_spec(m["spec"]["rayClusterSpec"])
