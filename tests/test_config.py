"""Config validation: errors name the key and the allowed values; shipped configs load."""

import pytest

from steprl.config import ConfigError, load_config


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.grup_size=3"])
    assert "rollout.grup_size" in str(e.value) and "group_size" in str(e.value)


def test_bad_value_names_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.context=everything"])
    assert "rollout.context" in str(e.value) and "append_only" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.advantage=magic"])
    assert "grpo" in str(e.value)


def test_overrides_parse_yaml_scalars(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  lr: 0.1\n")
    cfg = load_config(p, ["trainer.lr=3e-4", "logging.progress=false", "rollout.group_size=4"])
    assert cfg.trainer.lr == 3e-4 and cfg.logging.progress is False and cfg.rollout.group_size == 4


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainer.lr"])


def test_default_demo_config_is_valid():
    cfg = load_config("configs/calculator_tiny.yaml")
    assert cfg.derived()["trajectories_per_step"] == cfg.rollout.tasks_per_step * cfg.rollout.group_size


def test_every_shipped_config_loads_and_names_a_registered_env():
    from pathlib import Path

    from steprl.envs.registry import ENVS

    configs = sorted(Path("configs").glob("*.yaml"))
    assert len(configs) >= 7
    for path in configs:
        cfg = load_config(path)
        assert cfg.env.name in ENVS, path
        missing = set(cfg.model.sft.strategies) - set(ENVS[cfg.env.name].strategies)
        assert not missing, (path, missing)
