"""The docs are built from the code's own models and stay consistent with it:
the configuration reference is generated, every field is documented, the
deployment manifests agree with the discovery config they ship."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from pdgate.config import GatewayConfig
from pdgate.settings import config_reference, leaves

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_md_is_generated_from_the_model() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference(), "run: python scripts/gen_config_docs.py"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_every_config_field_is_documented() -> None:
    undocumented = [leaf.key for leaf in leaves() if not leaf.doc]
    assert not undocumented, f"add them to the class docstring's Attributes: {undocumented}"
    ref = config_reference()
    for leaf in leaves():
        assert f"`{leaf.key}`" in ref and leaf.env in ref and leaf.flag in ref


def test_readme_links_and_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    for link in ("docs/configuration.md", "docs/glossary.md", "docs/routing.md", "deploy/k8s",
                 "deploy/grafana/pdgate-dashboard.json", "deploy/prometheus/prometheus.yml"):
        assert link in readme, link
        assert (ROOT / link).exists(), link
    assert "bash scripts/test.sh" in readme
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    for term in ("TTFT", "TPOT", "ITL", "Goodput", "SLO", "Deflection", "Fallback", "Transfer bytes",
                 "Prefill", "Decode", "KV cache", "Block", "Admission", "Policy", "Connector", "Instance"):
        assert f"**{term}" in glossary or term in glossary, term


def test_k8s_manifests_match_the_gateway_config() -> None:
    docs = [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "pdgate"), ("Service", "pdgate"), ("Deployment", "vllm-prefill"),
            ("Deployment", "vllm-decode"), ("Role", "pdgate-pod-reader"), ("RoleBinding", "pdgate-pod-reader"),
            ("ServiceAccount", "pdgate")} <= kinds
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    cfg = GatewayConfig.model_validate(yaml.safe_load(cm["data"]["pdgate.yaml"]))   # valid as shipped
    disc = cfg.discovery
    assert disc.type == "kubernetes"
    for role, sel in (("prefill", disc.prefill_selector), ("decode", disc.decode_selector)):
        [dep] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"vllm-{role}"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert sel is not None
        assert all(labels.get(k) == v for k, v in (t.split("=") for t in sel.split(","))), (role, sel)
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert any(p["containerPort"] == disc.port for p in c["ports"])
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    [role] = [d for d in docs if d["kind"] == "Role"]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    [gw] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdgate"]
    assert gw["spec"]["template"]["spec"]["serviceAccountName"] == "pdgate" and gw["spec"]["replicas"] >= 2


def test_prometheus_example_parses() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    assert {"pdgate", "vllm", "pdgate-kv"} <= jobs
