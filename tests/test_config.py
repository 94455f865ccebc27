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


def test_every_shipped_config_loads_and_names_an_env_with_its_sft_strategies():
    from pathlib import Path

    from steprl.training.setup.env_setup import run_envs

    configs = sorted(Path("configs").glob("*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        cfg = load_config(path)
        run = run_envs(cfg)  # registered names and the gym / mcp families (built from params)
        missing = {cfg.model.sft.skill_strategy, *cfg.model.sft.strategies} - set(run.strategies())
        assert not missing, (path, missing)


def test_a_saved_config_with_env_server_plugins_still_loads(tmp_path):
    """Checkpoints saved before issue 11 name runtime.env_server_plugins: it is env.plugins now."""
    saved = tmp_path / "config.yaml"
    saved.write_text("runtime: {backend: http, env_server_plugins: [my_envs]}\nenv: {plugins: [other]}\n")
    cfg = load_config(saved)
    assert cfg.env.plugins == ["other", "my_envs"] and cfg.runtime.backend == "http"


@pytest.mark.parametrize("value", ["envs", "Env", "None", "tools"])
def test_a_mistyped_system_prompt_mode_names_the_modes(value):
    with pytest.raises(ConfigError, match="rollout.system_prompt"):
        load_config(None, [f"rollout.system_prompt={value}"])


def test_a_system_prompt_may_be_text():
    cfg = load_config(None, ["rollout.system_prompt=You are a careful agent."])
    assert cfg.rollout.system_prompt == "You are a careful agent."
