"""Config errors are one line naming the key and the allowed values or the fix (issue 13 item 7);
settings that are valid but meaningless are one warning line each (`config_warnings`).

Most cases go through `load_config` (and `check_host` / `env_spec`, which the CLI calls right
after it); a few run the real `steprl` command in subprocesses, started together so that the
torch import is paid once in wall time, and check exit 2, one output line and no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli_zygote
from steprl.config import ConfigError, load_config
from steprl.config.checks import check_device, check_host, check_output_dir, config_warnings
from steprl.envs.registry import EnvParamsError, UnknownEnvError
from steprl.errors import UserError
from steprl.training.setup.env_setup import env_spec

STEPRL = str(Path(sys.executable).parent / "steprl")
ROOT = Path(__file__).resolve().parents[1]
BAD_YAML = "run:\n  name: x\nrollout:\n  group_size: 4\n    tasks: 3\n"


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, list(overrides))
    msg = str(caught.value)
    assert "\n" not in msg and "{'" not in msg, msg  # one line, no section dumped back
    return msg


def _env_error(*overrides: str) -> str:
    with pytest.raises(UserError) as caught:
        env_spec(load_config(None, list(overrides)))
    assert "\n" not in str(caught.value)
    return str(caught.value)


# --- errors ---------------------------------------------------------------------------------------


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BAD_YAML)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}:5:10: YAML syntax error: mapping values are not allowed here"


def test_an_override_that_is_not_yaml_says_to_quote_it() -> None:
    msg = _error("trainer.betas=[0.9,")
    assert msg.startswith("override 'trainer.betas=[0.9,': the value is not valid YAML") and "quote" in msg


def test_an_unknown_env_name_lists_the_known_names() -> None:
    with pytest.raises(UnknownEnvError, match=r"unknown env 'nope'; known envs: .*calculator.*gym, mcp"):
        env_spec(load_config(None, ["env.name=nope"]))


def test_an_unknown_env_param_names_the_key_and_the_factorys_keys() -> None:
    msg = _env_error("env.params.bogus=1")
    assert msg.startswith("env.params: unknown key(s) bogus for env 'calculator'; allowed keys")
    assert "max_ops_per_call" in msg and "turn_cost" in msg


def test_an_unknown_task_param_names_the_key_and_the_generators_keys() -> None:
    msg = _env_error("env.task_params.max_ops=3")
    assert msg.startswith("env.task_params: unknown key(s) max_ops for env 'calculator'")
    assert "min_calls" in msg and "max_operand" in msg and "split" not in msg and "seed" not in msg


def test_env_params_pass_through_factories_that_take_kwargs() -> None:
    # code's factory takes **kwargs (it checks them itself); the gym/mcp families parse their own
    env_spec(load_config(None, ["env.name=code", "env.params.anything=1"]))


def test_task_params_with_a_task_file_are_refused_up_front(tmp_path: Path) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n')
    with pytest.raises(EnvParamsError, match="tasks from a file take no task params"):
        env_spec(load_config(None, [f"env.task_file.path={rows}", "env.task_params.min_calls=2"]))


def test_a_missing_device_names_the_allowed_devices() -> None:
    with pytest.raises(ConfigError) as caught:
        check_host(load_config(None, ["model.device=cuda:99"]))
    msg = str(caught.value)
    assert msg.startswith("model.device='cuda:99': no such device") and "allowed values: cpu" in msg
    with pytest.raises(ConfigError, match="'tpu' is not a torch device; allowed values: cpu"):
        check_device("tpu")
    check_device("cpu")


def test_a_missing_device_lists_the_cuda_devices_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"2 CUDA device.*allowed values: cpu, cuda, cuda:0\.\.cuda:1$"):
        check_device("cuda:7")
    check_device("cuda:1")


def test_an_output_dir_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(
        ConfigError, match=r"run.output_dir='.*afile/sub': .*afile is a file, not a directory"
    ):
        check_host(load_config(None, [f"run.output_dir={tmp_path / 'afile' / 'sub'}"]))
    check_output_dir(str(tmp_path / "new" / "deeper"), "run")  # made later, by the trainer
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_output_dir_is_one_line(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="is not writable"):
        check_output_dir(str(locked), "run")


def test_overlong_keys_are_checked_against_the_shaping_function() -> None:
    assert "algorithm.overlong: unknown key(s) foo; allowed keys: max_len, cache_len, penalty" in _error(
        "algorithm.overlong={foo: 1}"
    )
    assert "algorithm.overlong: missing key(s) cache_len" in _error("algorithm.overlong={max_len: 100}")
    assert "need 0 <= cache_len <= max_len" in _error("algorithm.overlong={max_len: 10, cache_len: 20}")
    ok = load_config(None, ["algorithm.overlong={max_len: 100, cache_len: 20}"])
    assert ok.algorithm.overlong == {"max_len": 100, "cache_len": 20}


def test_empg_keys_are_checked_against_entropy_modulated() -> None:
    assert "algorithm.empg: unknown key(s) kf; allowed keys: k, k_f, zeta" in _error("algorithm.empg={kf: 1}")
    assert load_config(None, ["algorithm.empg={k: 1.0, zeta: 0.2}"]).algorithm.empg == {"k": 1.0, "zeta": 0.2}


def test_betas_must_be_in_0_1() -> None:
    assert "trainer.betas: each beta must be in [0, 1) (got [2.0, -1.0])" in _error("trainer.betas=[2,-1]")
    assert load_config(None, ["trainer.betas=[0, 0.999]"]).trainer.betas == (0.0, 0.999)


def test_tiny_words_must_be_words_listed_once() -> None:
    assert "model.tiny.words: '/tmp' is not a word" in _error("model.tiny.words=[tmp, /tmp]")
    assert "model.tiny.words: 'tmp' is listed twice" in _error("model.tiny.words=[tmp, var, tmp]")


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["algorithm.kl_ctrl=adaptive"], "algorithm.kl_ctrl, algorithm.kl_in, algorithm.kl_coef: "),
        (
            ["algorithm.advantage=gae", "algorithm.advantage_params={}"],
            "algorithm.advantage, algorithm.critic: ",
        ),
        (
            ["algorithm.aggregation=seq-mean-token-sum-norm"],
            "algorithm.aggregation, algorithm.loss_scale_factor: ",
        ),
        (["model.format=chat"], "model.name, model.format: "),
    ],
)
def test_a_cross_field_error_names_each_field_and_not_the_section(overrides: list[str], fields: str) -> None:
    msg = _error(*overrides)
    assert msg.startswith(f"invalid config: {fields}"), msg
    assert "got {" not in msg and "'advantage_params'" not in msg


def test_a_kl_ctrl_error_says_what_it_got() -> None:
    assert "(got kl_in=loss, kl_coef=0.0)" in _error("algorithm.kl_ctrl=adaptive")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_non_finite_number_is_one_clear_line(value: str) -> None:
    msg = _error(f"trainer.lr={value}")
    assert msg.startswith("invalid config: trainer.lr: Input should be a finite number (got ")


def test_several_errors_are_one_line_each_named() -> None:
    msg = _error("trainer.lr=.nan", "rollout.grup_size=3", "model.lora.rr=3")
    assert "rollout.grup_size: unknown key; allowed keys here: cap_truncation, context, " in msg
    assert ", group_size, " in msg.split("rollout.grup_size")[1].split(";")[1]
    assert "model.lora.rr: unknown key; allowed keys here: alpha, dropout, r, target_modules" in msg
    assert "trainer.lr: Input should be a finite number" in msg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "run.seed=-1",
            "run.seed: Input should be greater than or equal to 0 (got -1); "
            "allowed values: an integer >= 0 and <= 4294967295",
        ),
        (f"run.seed={2**70}", "run.seed: Input should be less than or equal to 4294967295"),
        ("run.name=" + "a" * 201, "run.name: 201 characters, over the 200 a run name may have"),
        (
            "model.tiny.num_heads=5",
            "model.tiny.hidden_size, model.tiny.num_heads: hidden_size=96 is not a multiple of "
            "num_heads=5 (each head takes an equal share); e.g. num_heads=4",
        ),
        (
            "model.tiny.hidden_size=1000000",
            "model.tiny.hidden_size: Input should be less than or equal to 8192",
        ),
        ("model.tiny.num_layers=100000", "model.tiny.num_layers: Input should be less than or equal to 256"),
        (
            "model.tiny.intermediate_size=1000000",
            "model.tiny.intermediate_size: Input should be less than or equal to 32768",
        ),
        ("model.tiny.num_heads=1024", "model.tiny.num_heads: Input should be less than or equal to 256"),
        ("rollout.group_size=1000000000", "rollout.group_size: Input should be less than or equal to 1024"),
        (
            "rollout.tasks_per_step=1000000000",
            "rollout.tasks_per_step: Input should be less than or equal to 65536",
        ),
        ("trainer.eval_tasks=1000000000", "trainer.eval_tasks: Input should be less than or equal to 100000"),
    ],
)
def test_sizes_out_of_range_are_one_line_naming_the_key_and_the_range(override: str, needle: str) -> None:
    """The fault battery's huge and negative sizes: tracebacks, hangs and memory exhaustion before."""
    assert needle in _error(override)


def test_trajectories_per_step_have_a_cap() -> None:
    msg = _error("rollout.group_size=1024", "rollout.tasks_per_step=65536")
    assert msg.startswith(
        "invalid config: rollout.group_size, rollout.tasks_per_step: 1024 x 65536 = 67108864 trajectories "
        "per step, over the 262144 a step may have"
    ), msg
    assert (
        load_config(None, ["rollout.group_size=4", "rollout.tasks_per_step=65536"]).derived()[
            "trajectories_per_step"
        ]
        == 262144
    )


def test_a_tiny_model_over_half_the_memory_is_refused_before_it_is_built() -> None:
    big = ["model.tiny.hidden_size=8192", "model.tiny.num_layers=256", "model.tiny.intermediate_size=32768"]
    with pytest.raises(ConfigError, match=r"^model.tiny: about [0-9,]+ parameters need about [0-9.]+ GiB "):
        check_host(load_config(None, big))
    check_host(load_config(None, big), device=False)  # check-env builds no model


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match=r"^model.cache_dir='.*afile': a file, not a directory; "):
        check_host(load_config(None, [f"model.cache_dir={afile}"]))
    check_host(load_config(None, [f"model.cache_dir={tmp_path / 'new'}"]))  # made by the warm start


def test_an_import_path_to_something_else_is_one_line_before_it_is_called() -> None:
    """`os:system` was called with the run's arguments (a TypeError traceback at best)."""
    from steprl.training.controllers import Controllers
    from steprl.training.sources import make_source
    from steprl.training.sources.check import synthetic_tasks

    with pytest.raises(ConfigError) as caught:
        make_source("os:system", lambda: synthetic_tasks(0), 0)
    assert str(caught.value).startswith(
        "env.source 'os:system' is a builtin_function_or_method, not a task source class"
    )
    with pytest.raises(ConfigError, match=r"^env.source 'os:path' is a module, not a task source class"):
        make_source("os:path", lambda: synthetic_tasks(0), 0)
    with pytest.raises(
        ConfigError, match=r"^trainer.controllers 'os:system' is a builtin_function_or_method, not "
    ):
        Controllers.for_config(load_config(None, ["trainer.controllers=[os:system]"]))


# --- warnings -------------------------------------------------------------------------------------


def _warnings(*overrides: str, **kw: int) -> list[str]:
    return config_warnings(load_config(None, list(overrides)), **kw)


def test_no_warning_for_the_defaults_or_the_shipped_demo() -> None:
    assert _warnings() == []
    assert config_warnings(load_config(ROOT / "configs" / "calculator_tiny.yaml")) == []


def test_keep_last_k_without_a_window_warns() -> None:
    (line,) = _warnings("rollout.keep_last_k=3")
    assert line.startswith("rollout.keep_last_k=3 has no effect under rollout.context=append_only")
    assert _warnings("rollout.keep_last_k=3", "rollout.context=keep_last_k") == []


def test_a_critic_no_advantage_reads_warns() -> None:
    (line,) = _warnings("algorithm.critic=separate")
    assert (
        line.startswith("algorithm.critic=separate is trained but unused: advantage=grpo") and "gae" in line
    )
    assert (
        _warnings("algorithm.critic=separate", "algorithm.advantage=gae", "algorithm.advantage_params={}")
        == []
    )


def test_kl_in_reward_without_a_coefficient_warns() -> None:
    (line,) = _warnings("algorithm.kl_in=reward")
    assert line.startswith("algorithm.kl_in=reward has no effect with algorithm.kl_coef=0")
    assert _warnings("algorithm.kl_in=reward", "algorithm.kl_coef=0.001") == []


def test_options_of_an_unselected_backend_warn() -> None:
    lines = _warnings("runtime.env_server_url=http://127.0.0.1:8765", "runtime.rollout_workers=2")
    assert lines == [
        "runtime.env_server_url is set but runtime.backend=inprocess: only backend=http reads it",
        "runtime.rollout_workers=2 has no effect with runtime.backend=inprocess: only backend=ray reads it",
    ]
    assert _warnings("runtime.backend=ray", "runtime.env_workers=4", "runtime.rollout_workers=2") == []
    (line,) = _warnings("runtime.backend=http", "runtime.env_workers=4")
    assert line.startswith("runtime.env_workers=4 has no effect with runtime.backend=http")


def test_max_total_tokens_beyond_the_models_positions_warns() -> None:
    (line,) = _warnings("rollout.max_total_tokens=1000")
    assert line.startswith(
        "rollout.max_total_tokens=1000 is beyond the model's 512 positions (model.name=tiny)"
    )
    assert _warnings("model.name=some/model", "rollout.max_total_tokens=100000") == []  # unknown: not checked
    (line,) = _warnings("model.name=some/model", "rollout.max_total_tokens=4096", max_positions=2048)
    assert "beyond the model's 2048 positions" in line


# --- the command line: exit 2, one line, no traceback --------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    """Each case's (exit code, stdout + stderr), the processes run at the same time."""
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "bad.yaml"
    bad.write_text(BAD_YAML)
    ok = tmp / "ok.yaml"
    ok.write_text(f"run: {{output_dir: {tmp / 'runs'}}}\nlogging: {{tensorboard: false, progress: false}}\n")
    cases = {
        "yaml": [STEPRL, "train", str(bad)],
        "device": [STEPRL, "train", str(ok), "--set", "model.device=cuda:99"],
        "cross_field": [STEPRL, "check-env", str(ok), "--set", "algorithm.kl_ctrl=adaptive"],
        "env_param": [STEPRL, "check-env", "calculator", "--set", "env.params.bogus=1"],
        "seed": [STEPRL, "check-env", str(ok), "--set", "run.seed=-1"],
    }
    env = {**os.environ, "COLUMNS": "80"}  # a long message must not wrap into several lines
    procs = {
        name: cli_zygote.popen(
            argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, argv in cases.items()
    }
    outputs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    return {name: (procs[name].returncode, out.strip()) for name, out in outputs.items()}


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("yaml", "bad.yaml:5:10: YAML syntax error: mapping values are not allowed here"),
        ("device", "model.device='cuda:99': no such device"),
        ("cross_field", "invalid config: algorithm.kl_ctrl, algorithm.kl_in, algorithm.kl_coef: "),
        ("env_param", "env.params: unknown key(s) bogus for env 'calculator'; allowed keys"),
        ("seed", "invalid config: run.seed: Input should be greater than or equal to 0"),
    ],
)
def test_the_cli_prints_one_line_and_exits_2(
    cli_runs: dict[str, tuple[int, str]], case: str, needle: str
) -> None:
    rc, out = cli_runs[case]
    assert rc == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert needle in out, out


@pytest.mark.parametrize("setting", ["runtime.learner_gpus_per_rank=1", "runtime.learner_cpu_offload=true"])
def test_a_setting_of_learner_ranks_without_ranks_is_one_line(setting: str) -> None:
    from steprl.training.setup.build import _refuse_combinations

    with pytest.raises(UserError, match=r"is a setting of learner ranks \(runtime.learner_ranks > 1\)"):
        _refuse_combinations(load_config(None, [setting]), None)  # type: ignore[arg-type]
    _refuse_combinations(load_config(None, [setting, "runtime.learner_ranks=2"]), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (["runtime.weight_sync=broadcast"], "sends the weights to Ray rollout workers"),
        (
            [
                "runtime.weight_sync=broadcast",
                "runtime.backend=ray",
                "runtime.rollout_workers=1",
                "rollout.cross_policy={snapshots: 2}",
                "algorithm.policy_loss=decoupled_ppo",
            ],
            "rollout.cross_policy with runtime.weight_sync=broadcast",
        ),
    ],
    ids=["no-workers", "cross-policy"],
)
def test_a_broadcast_sync_without_what_it_needs_is_one_line(settings: list[str], needle: str) -> None:
    from steprl.training.setup.build import _refuse_combinations

    with pytest.raises(UserError, match=re.escape(needle)):
        _refuse_combinations(load_config(None, settings), None)  # type: ignore[arg-type]


def test_a_delta_sync_without_object_store_workers_is_one_line() -> None:
    from steprl.training.setup.build import _refuse_combinations

    ray = ["runtime.backend=ray", "runtime.rollout_workers=1", "runtime.weight_delta=true"]
    for extra in (["runtime.rollout_workers=0"], ["runtime.weight_sync=broadcast"]):
        with pytest.raises(
            UserError, match=re.escape("runtime.weight_delta sends deltas to Ray rollout workers")
        ):
            _refuse_combinations(load_config(None, [*ray, *extra]), None)  # type: ignore[arg-type]


def test_a_private_ray_has_the_slots_the_run_reserves() -> None:
    from steprl.training.setup.env_setup import ray_slots

    cfg = load_config(
        None,
        [
            "runtime.backend=ray",
            "runtime.learner_ranks=2",
            "runtime.rollout_workers=2",
            "runtime.env_workers=1",
        ],
    )
    assert ray_slots(cfg) == 2 + 2 + 0.25 * 3  # ranks, workers, env actors (the trainer's and 2 workers')
    assert ray_slots(load_config(None, [])) == 0
