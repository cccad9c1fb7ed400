"""ServerSettings: serve_config.yaml's args, environment fallbacks, the tree directory, deployment options."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from config import ServerSettings

ROOT = Path(__file__).resolve().parents[2]


def _yaml_args() -> dict:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    return dict(app["args"])


def test_serve_config_args_are_valid_settings(monkeypatch):
    for var in ("REDIS_URL", "ADMIN_TOKEN", "DATA_DIR", "MODEL"):
        monkeypatch.delenv(var, raising=False)
    settings = ServerSettings.from_args(_yaml_args())
    assert settings.data_dir == "./data" and settings.redis_url is None and settings.model is None


def test_environment_fills_what_serve_config_leaves_null(monkeypatch, tmp_path):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6390/0")
    monkeypatch.setenv("ADMIN_TOKEN", "from-env")
    settings = ServerSettings.from_args(_yaml_args())
    assert settings.data_dir == str(tmp_path)
    assert settings.redis_url == "redis://127.0.0.1:6390/0" and settings.admin_token == "from-env"
    # An explicit value wins over the environment.
    assert ServerSettings.from_args({"data_dir": "/srv/cs"}).data_dir == "/srv/cs"


def test_unknown_args_are_refused():
    with pytest.raises(ValueError, match="data_dri"):
        ServerSettings.from_args({"data_dri": "x"})


def test_tree_paths_resolve_inside_the_tree_directory(tmp_path):
    settings = ServerSettings(data_dir=str(tmp_path))
    root = os.path.realpath(tmp_path / "trees")
    assert settings.tree_root == root
    assert settings.resolve_tree_path("a/b.json") == os.path.join(root, "a", "b.json")
    assert settings.resolve_tree_path(os.path.join(root, "c.json")) == os.path.join(root, "c.json")
    for escape in ("../x.json", "/etc/passwd", "a/../../x.json"):
        with pytest.raises(ValueError, match="tree directory"):
            settings.resolve_tree_path(escape)
    other = ServerSettings(data_dir=str(tmp_path), tree_dir=str(tmp_path / "elsewhere"))
    assert other.tree_root == os.path.realpath(tmp_path / "elsewhere")


def test_placement_settings_reach_the_deployment_options():
    from deployments.app import deployment_options

    plain = deployment_options(ServerSettings())
    assert "max_replicas_per_node" not in plain["model"]
    assert all("resources" not in o["ray_actor_options"] for o in plain.values())
    placed = deployment_options(ServerSettings(max_replicas_per_node=1,
                                               custom_resources={"manager": {"head": 0.01}, "model": {"gpu_node": 1}}))
    assert placed["model"]["max_replicas_per_node"] == 1
    assert placed["manager"]["ray_actor_options"]["resources"] == {"head": 0.01}
    assert placed["model"]["ray_actor_options"]["resources"] == {"gpu_node": 1}
    assert "resources" not in placed["ingress"]["ray_actor_options"]
    with pytest.raises(ValueError):
        ServerSettings(custom_resources={"proxy": {"x": 1}})
