"""Config values are checked, never coerced (issue 23 item 11): a string is not a count, `true`
is not a number, a clip is not negative; each is one line naming the key and the allowed values.
Ints stay valid for float fields, and `1e-4` is a number as users mean it."""

from __future__ import annotations

from pathlib import Path

import pytest

from steprl.config import ConfigError, load_config

BAD = [
    # (override, the key named, the allowed values named)
    ("rollout.group_size='8'", "rollout.group_size", "an integer > 0"),
    ("trainer.total_steps=true", "trainer.total_steps", "an integer >= 0"),
    ("trainer.lr=true", "trainer.lr", "a number > 0"),
    ("trainer.lr='3e-4'", "trainer.lr", "a number > 0"),
    ("logging.progress=1", "logging.progress", "true or false"),
    ("trainer.total_steps=2.5", "trainer.total_steps", "an integer >= 0"),
    ("algorithm.loss_params.clip_low=-5", "algorithm.loss_params.clip_low", "a number >= 0 and < 1"),
    ("algorithm.loss_params.clip_high='0.28'", "algorithm.loss_params.clip_high", "a number >= 0"),
    ("algorithm.advantage_params.scale_by_std=yes please", "algorithm.advantage_params.scale_by_std", "true"),
    ("algorithm.advantage_params.eps=-1", "algorithm.advantage_params.eps", "a number >= 0"),
    ("algorithm.filter_params={}", None, None),  # valid: a control row
    ("rollout.top_p=1.5", "rollout.top_p", "a number > 0 and <= 1"),
    ("runtime.failure_budget=-0.1", "runtime.failure_budget", "a number >= 0 and <= 1"),
    ("algorithm.value_clip=-1", "algorithm.value_clip", "a number > 0 or null"),
    ("model.sft.strategies={expert: -0.3}", "model.sft.strategies.expert", "a number >= 0"),
    ("model.lora={r: '16'}", "model.lora.r", "an integer > 0"),
    ("trainer.betas=[0.9, '0.99']", "trainer.betas.1", "a number"),
]


@pytest.mark.parametrize(("override", "key", "allowed"), BAD, ids=[b[0] for b in BAD])
def test_a_wrong_type_or_range_is_one_line_naming_key_and_allowed_values(
    override: str, key: str | None, allowed: str | None
) -> None:
    if key is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    msg = str(caught.value)
    assert "\n" not in msg, msg
    assert f"{key}: " in msg and allowed in msg.split("allowed values: ", 1)[1], msg


def test_a_quoted_number_in_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_size: '8'\n")
    with pytest.raises(ConfigError, match=r"rollout\.group_size: .*\(got '8'\)"):
        load_config(path)


def test_ints_are_numbers_and_exponents_are_floats(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1\n  betas: [0, 0.999]\nalgorithm:\n  kl_coef: 0\n  critic_lr: 1e-5\n")
    cfg = load_config(path, ["algorithm.loss_params.clip_high=1", "rollout.temperature=2E0"])
    assert cfg.trainer.lr == 1.0 and cfg.trainer.betas == (0.0, 0.999) and cfg.algorithm.kl_coef == 0.0
    assert cfg.algorithm.critic_lr == 1e-5 and cfg.rollout.temperature == 2.0
    assert cfg.algorithm.loss_params["clip_high"] == 1
