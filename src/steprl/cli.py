"""The `steprl` command line: train, sft, eval, check-env, serve-env, synth, ..."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from steprl.hosting.command import serve_env

if TYPE_CHECKING:
    from steprl.config import Config
    from steprl.training.setup.env_setup import RunEnv

app = typer.Typer(add_completion=False, no_args_is_help=True, help="steprl: agentic RL for tool-using LMs.")
console = Console()


PLUGIN_HELP = "Module to import first; it registers your envs (repeatable; added to env.plugins)."


def _load(
    config: Path | None,
    overrides: Sequence[str],
    plugins: Sequence[str] = (),
    *,
    device: bool = True,
    output_dir: bool = False,
    env: bool = True,
) -> Config:
    """The validated config, checked before any work: `model.device` exists here (`device`),
    `run.output_dir` can hold the run (`output_dir`), `env.name` resolves and takes
    `env.params` / `env.task_params` (`env`). Each failure is one line and exit 2."""
    # imported here, not at the top: steprl.config imports torch (~1.5 s), which `steprl --help`
    # and `steprl serve-env` do not need
    from steprl.config import ConfigError, load_config
    from steprl.config.checks import check_host
    from steprl.envs.registry import load_plugins

    try:
        cfg = load_config(config, overrides)
        check_host(cfg, device=device, output_dir=output_dir)
    except ConfigError as err:
        console.print(str(err), style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if plugins:
        merged = [*cfg.env.plugins, *(p for p in plugins if p not in cfg.env.plugins)]
        cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"plugins": merged})})
    load_plugins(cfg.env.plugins)  # now: a plugin that does not import is one line, before any work
    if env:  # a bad env name or param: one line now, not after the run directory is made
        from steprl.training.setup.env_setup import run_envs

        run_envs(cfg)
    return cfg


@app.command()
def train(
    config: Path | None = typer.Argument(
        None, help="YAML config (see configs/); with --resume alone, the run directory's config.yaml."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set trainer.lr=3e-4 (repeatable)."),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        help="Continue the run in this directory from its latest complete checkpoint (run.resume=must), "
        "as it was configured (its config.yaml) unless CONFIG is given.",
    ),
) -> None:
    """Train a policy with RL; prints held-out success before and after. A run killed or
    interrupted continues exactly with --resume runs/<name> (or run.resume=auto)."""
    if resume is not None:  # the run directory named on the command line, whatever the config says
        if resume.name in ("", ".", ".."):  # `--resume .`: name the directory itself
            resume = resume.resolve()
        if config is None:  # the run's own config: every override and plugin it was started with
            config = resume / "config.yaml"
            if not config.is_file():
                console.print(
                    f"--resume {resume}: no config.yaml there, so not a run directory; check the path, "
                    "or give the run's CONFIG too",
                    style="red",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(2)
        set_ = [*set_, "run.resume=must", f"run.output_dir={resume.parent}", f"run.name={resume.name}"]
    elif config is None:
        console.print("[red]steprl train: give a CONFIG (see configs/), or --resume RUN_DIR[/red]")
        raise typer.Exit(2)
    cfg = _load(config, set_, plugin, output_dir=True)
    # imported after the config is checked: a config error is one line in ~3 s, not after the
    # trainer's imports
    from steprl.training.loop.held_out import describe_eval
    from steprl.training.loop.trainer import train as run_training

    result = run_training(cfg, log=console.print)
    w, f = result.warm_start, result.final
    for label, m in (("warm start", w), ("RL-trained", f)):
        if m and describe_eval(m).startswith("eval failed"):
            console.print(f"[red]{label}: {describe_eval(m)}[/red]")
            console.print(f"run directory: {result.run_dir}")
            raise typer.Exit(1)
    console.print(
        f"\n[bold]held-out success[/bold] ({int(f['eval/tasks'])} tasks, "
        f"temperature {cfg.trainer.eval_temperature}):"
    )
    for label, m in (("warm start", w), ("RL-trained", f)):
        console.print(
            f"  {label:<11}: success {m['eval/success']:.3f}  tool-call rate {m['eval/tool_call_rate']:.3f}  "
            f"calls/solved {m['eval/calls_per_success']:.2f}"
            if m
            else f"  {label:<11}: not recorded (its metrics.jsonl line could not be read)"
        )
    console.print(f"run directory: {result.run_dir}")
    if (result.run_dir / "report.html").exists():
        console.print(f"report: {result.run_dir / 'report.html'} (open it in a browser)")


@app.command()
def sft(
    config: Path = typer.Argument(Path("configs/calculator_tiny.yaml"), help="YAML config."),
    set_: list[str] = typer.Option([], "--set", help="Override a key (repeatable)."),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
) -> None:
    """Warm-start the tiny policy on scripted demonstrations (cached under model.cache_dir, unset:
    $STEPRL_CACHE or ~/.cache/steprl; keyed on the config, the env's code and its tasks)."""
    from steprl.training.setup import env_setup
    from steprl.training.setup.policy import load_policy

    cfg = _load(config, set_, plugin)
    if cfg.model.name != "tiny":
        console.print("[red]model.name must be 'tiny': sft warm-starts the embedded policy[/red]")
        raise typer.Exit(2)
    with env_setup.env_pool(cfg) as envs:
        run = env_setup.run_envs(cfg)
        env_setup.check_env_starts(envs, run, cfg, console.print)
        policy = load_policy(cfg, log=console.print, make_env=envs.make_env, run=run)
    console.print(f"policy: {policy.source}", markup=False, highlight=False, soft_wrap=True)


@app.command("eval")
def eval_(
    checkpoint: Path = typer.Argument(
        ..., help="A run directory (its latest checkpoint) or runs/<name>/checkpoints/step_N."
    ),
    tasks: int | None = typer.Option(
        None, help="Number of held-out tasks [default: the run's trainer.eval_tasks]."
    ),
    temperature: float = typer.Option(1.0, help="Sampling temperature."),
    set_: list[str] = typer.Option([], "--set", help="Override a key of the checkpoint's config."),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
) -> None:
    """Evaluate a checkpoint on held-out tasks."""
    from steprl.training.commands.evaluate_cli import evaluate_checkpoint
    from steprl.training.learn.checkpoint import resolve_checkpoint

    # a run directory or checkpoints/ means its newest checkpoint that verifies (a corrupt one
    # falls back, with a warning); a checkpoint named by its path that fails is one line, exit 2
    def warn(line: str) -> None:
        console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)

    checkpoint = resolve_checkpoint(checkpoint, warn)
    console.print(f"checkpoint: {checkpoint}", markup=False, highlight=False)
    cfg = _load(checkpoint / "config.yaml", set_, plugin)  # the checkpoint's own config
    metrics = evaluate_checkpoint(checkpoint, cfg, tasks=tasks, temperature=temperature)
    for k, v in metrics.items():
        console.print(f"  {k}: {v:.4f}")


@app.command("check-env")
def check_env_cmd(
    target: str = typer.Argument(
        ...,
        help="An env name (registered, gym/mcp family, package.module:attr, entry point) or a YAML config.",
    ),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
    set_: list[str] = typer.Option([], "--set", help="Override a key of the YAML config (repeatable)."),
    tasks: int = typer.Option(20, help="Tasks to sample (per split)."),
    seed: int = typer.Option(0, help="Seed of the task stream and the policies."),
    call_timeout_s: float | None = typer.Option(
        None,
        "--call-timeout-s",
        min=0.001,
        help="Deadline of one env call, and of each task the task factory yields, in seconds "
        "(default: the config's runtime.env_call_timeout_s, 30).",
    ),
) -> None:
    """Run the conformance checker on one environment: API, determinism, robustness, expert
    solvability; stochastic and live envs run the checks their spec declares (see the report).
    A YAML config checks its `env` section (name, params, task_params, task_file, plugins).
    An env call that hangs fails the check after the deadline (--call-timeout-s)."""
    from steprl.training.setup import env_setup

    overrides = list(set_)
    if not target.endswith((".yaml", ".yml")):
        overrides = [f"env.name={target}", *overrides]
    path = Path(target) if target.endswith((".yaml", ".yml")) else None
    cfg = _load(path, overrides, plugin, device=False, env=False)  # run_envs: below
    for env in env_setup.run_envs(cfg).envs:  # a config with a list of envs: each of them
        _check_one_env(env, tasks, seed, call_timeout_s or cfg.runtime.env_call_timeout_s)


def _check_one_env(env: RunEnv, tasks: int, seed: int, call_timeout_s: float) -> None:
    """`steprl check-env` on one env of a config (an `env_setup.RunEnv`)."""
    from steprl.envs.check import EnvCheckError, check_spec
    from steprl.errors import UserError

    try:
        report = check_spec(
            env.spec,
            n_tasks=tasks,
            seed=seed,
            env_params=env.entry.params,
            task_params=env.entry.task_params,
            call_timeout_s=call_timeout_s,
        )
    except UserError:
        raise  # a bad name, plugin or param: one line and exit 2, as from every command
    except EnvCheckError as err:
        if isinstance(err.__cause__, UserError):  # a bad task row: the input's fault, as in train
            raise err.__cause__ from None
        console.print(f"check-env {env.entry.name}: {err}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    except (KeyError, ValueError) as err:
        console.print(f"check-env {env.entry.name}: {err}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"[green]{env.entry.name}: ok[/green]")
    console.print(report.summary(), markup=False, highlight=False, soft_wrap=True)


@app.command("synth")
def synth_cmd(
    spec: Path = typer.Argument(..., help="A tool-documentation YAML (see configs/synth/)."),
    out: Path = typer.Option(..., "-o", "--out", help="The env package directory to write (new or empty)."),
    check: bool = typer.Option(True, help="Run check-env on the package once written."),
    writer_url: str | None = typer.Option(
        None, help="An OpenAI-compatible endpoint (…/v1) whose model writes `template: written` tools' code."
    ),
    writer_model: str | None = typer.Option(
        None,
        help="The writer's model: its name at --writer-url, or what model.name takes with --writer-engine.",
    ),
    writer_key_env: str = typer.Option("", help="The environment variable holding the writer's API key."),
    writer_engine: str | None = typer.Option(
        None, help="hf or vllm: serve --writer-model with a steprl engine in this process (no endpoint)."
    ),
    allow_written_code: bool = typer.Option(
        False, help="Run the code: of the spec's written tools (read it first); it runs only in bubblewrap."
    ),
) -> None:
    """Synthesize an env package from tool documentation: a typed state, tools over it, tasks
    from walks over the tools' dependency graph with a golden final state, each validated (its
    reference plan reaches the golden state; do-nothing, read-only, read-free and write-everything
    probes do not) before admission. Train on it with env.name: synth, env.params: {path: OUT}."""
    from steprl.envs.synth.engine_chat import engine_chat_from
    from steprl.envs.synth.package import load_package, write_package
    from steprl.envs.synth.writer import EngineWriter, ToolWriter, Writer
    from steprl.errors import UserError

    if (writer_url is None and writer_engine is None) != (writer_model is None) or (
        writer_url and writer_engine
    ):
        raise UserError(
            "--writer-model goes with either --writer-url (an OpenAI-compatible endpoint) or --writer-engine "
            "(hf or vllm: the model in this process), not both"
        )
    writer: Writer | None = None
    if writer_url and writer_model:
        writer = ToolWriter(writer_url, writer_model, writer_key_env)
    elif writer_engine and writer_model:
        raw = {"engine": writer_engine, "model": writer_model}
        writer = EngineWriter(engine_chat_from(raw, "--writer", UserError, sep="-", timeout_s=600.0))
    errors = Console(stderr=True)  # progress on stderr: stdout keeps the one line of a result or error

    def say(line: str) -> None:
        errors.print(line, markup=False, highlight=False, soft_wrap=True)

    report = write_package(spec, out, writer, allow_written_code, progress=say)
    console.print(
        f"{out}: {report.admitted} tasks admitted of {report.generated} generated "
        f"({report.validated_share:.0%} validated; probe wins {report.probe_wins}); "
        f"random {report.random_success:.1%}, do-nothing {report.do_nothing_success:.1%}; "
        f"{report.train_tasks} train tasks over {report.shapes_train} shapes, {report.eval_tasks} eval "
        f"over {report.shapes_eval} held-out shapes; {report.seconds:.1f} s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if check:
        from steprl.envs.check import check_spec

        # the code in the package is what this command was allowed to run (or its writer wrote)
        summary = check_spec(load_package(out, allow_written_code=True), n_tasks=20, seed=0).summary()
        console.print(f"[green]check-env: ok[/green] {summary}", highlight=False, soft_wrap=True)


@app.command("check-template")
def check_template_cmd(
    model: str = typer.Argument(
        ...,
        help="What model.name takes: tiny, qwen3-testbed, gemma-3-270m, a HF directory, a Hub id (org/name) "
        "or a .gguf file.",
    ),
    conversations: Path | None = typer.Option(
        None, help='A JSONL file of {"tools": [...], "messages": [...]} conversations to check instead.'
    ),
    chat_template: Path | None = typer.Option(
        None, help="A Jinja chat template to check instead of the tokenizer's."
    ),
    context: str | None = typer.Option(
        None, help="Only this context rule (append_only, keep_thinking, strip_thinking)."
    ),
    cache_dir: str | None = typer.Option(
        None, help="Where converted models are cached (model.cache_dir; unset: $STEPRL_CACHE or ~/.cache)."
    ),
) -> None:
    """Render multi-turn tool conversations incrementally (as the agent loop does) and whole, and
    report the first token where they differ, with the decoded context. Exit 1 on an
    unexpected difference."""
    from steprl.training.commands.template_cli import run_checks

    if context is not None and context not in ("append_only", "keep_thinking", "strip_thinking"):
        from steprl.config import ConfigError

        raise ConfigError(
            f"--context={context!r}; allowed values: append_only, keep_thinking, strip_thinking"
        )
    checks = run_checks(
        model,
        conversations=str(conversations) if conversations else None,
        chat_template=str(chat_template) if chat_template else None,
        context=context,
        cache_dir=cache_dir,
        log=lambda m: console.print(m, markup=False, highlight=False),
    )
    failed = False
    for label, report, expected in checks.results:
        verdict = ("expected break: " if expected and not report.ok else "") + report.summary()
        if expected and report.ok:
            verdict += " (no break: this template keeps earlier reasoning)"
        console.print(f"{label}\n  {verdict}", markup=False, highlight=False, soft_wrap=True)
        failed |= not report.ok and not expected
    plain = " (the plain format: the tokenizer has no chat template)" if checks.format == "plain" else ""
    console.print(
        f"check-template {model}: " + ("FAIL" if failed else "ok") + plain,
        style="red" if failed else "green",
        markup=False,
    )
    if failed:
        raise typer.Exit(1)


@app.command("show")
def show_cmd(
    run: Path = typer.Argument(..., help="A run directory (runs/<name>)."),
    step: int | None = typer.Option(None, help="The step (with --eval: the evaluation's); default: last."),
    task: str | None = typer.Option(None, help="This task's episodes turn by turn (else a summary)."),
    eval_: bool = typer.Option(False, "--eval", help="The held-out evaluations' episodes instead."),
) -> None:
    """A step's saved episodes in the terminal: a summary, or one task's episodes turn by turn,
    the model's tokens coloured by advantage and the masked prompt and observations dimmed."""
    from steprl.diagnostics.show import show_run

    show_run(run, step=step, task=task, evaluated=eval_, console=console)


@app.command("serve-policy")
def serve_policy_cmd(
    config: Path = typer.Argument(..., help="YAML config: its model section is served."),
    port: int = typer.Option(8000, help="The loopback port."),
    set_: list[str] = typer.Option([], "--set", help="Override a key (repeatable)."),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
) -> None:
    """The config's policy behind an OpenAI-compatible endpoint on 127.0.0.1 (chat completions with
    tools and streaming, completions, models), recording every call's exact token ids and
    log-probs: appended to the session's trajectory when the harness kept the history as
    sampled, a new sample (a counted branch) when it did not; ids and log-probs of unequal
    length fail the call."""
    cfg = _load(config, set_, plugin)
    from steprl.training.commands.serve_policy import serve_policy

    serve_policy(cfg, port, log=lambda m: console.print(m, markup=False, highlight=False))


# `steprl serve-env`: the env server. Defined in steprl.hosting.command so that LocalEnvServer can
# start it as `python -m steprl.hosting` without importing torch.
app.command("serve-env")(serve_env)


@app.command("report")
def report_cmd(
    run: Path = typer.Argument(..., help="A run directory (runs/<name>)."),
    vs: list[Path] = typer.Option([], "--vs", help="Another run to compare with (repeatable)."),
    out: Path | None = typer.Option(None, "-o", "--out", help="The HTML file (default: RUN/report.html)."),
) -> None:
    """One self-contained HTML file (opens offline): config (and its diff with --vs), curves, the
    saved episodes with tokens coloured by advantage, and the learning diff of a held-out task."""
    from steprl.report import write_report

    for d in (run, *vs):
        if not (d / "metrics.jsonl").exists() and not (d / "config.yaml").exists():
            why = f"{d} is not a run directory (no metrics.jsonl or config.yaml); give runs/<name>"
            console.print(why, style="red", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    written = write_report(run, out, vs=vs)
    size = f"{written.bytes / 2**20:.1f} MiB, {written.episodes} episodes"
    console.print(f"report: {written.path} ({size})", markup=False, highlight=False, soft_wrap=True)


@app.command("export")
def export_cmd(
    run: Path = typer.Argument(..., help="A run directory (runs/<name>)."),
    out: Path | None = typer.Option(
        None, "-o", "--out", help="Where to write (a new directory); default: RUN/atif/train (or eval)."
    ),
    eval_: bool = typer.Option(False, "--eval", help="Export the held-out evaluation episodes instead."),
    format_: str = typer.Option("atif", "--format", help="The output format: atif (ATIF v1.7 JSON)."),
) -> None:
    """Write a run's saved episodes as ATIF trajectories (one JSON file per episode), keeping
    steprl's exact token ids, log-probs, versions and advantages in ATIF's extension fields:
    steprl.diagnostics.atif.import_atif reads them back into the Parquet columns, bit for bit."""
    from steprl.diagnostics.atif import export_run
    from steprl.errors import UserError

    if format_ != "atif":
        raise UserError(f"--format {format_}: the one export format is atif; leave --format out")
    files = export_run(run, out, eval=eval_)
    where = files[0].parent.parent
    console.print(f"wrote {len(files)} episodes as ATIF to {where}", markup=False, highlight=False)


def main() -> None:
    """The `steprl` command: a `UserError` (a missing extra, a plugin that does not import, a bad
    task row, ...) is one line and exit code 2, not a traceback."""
    from steprl.errors import RunAborted, UserError

    try:
        app(sys.argv[1:])
    except UserError as err:
        console.print(str(err), style="red", markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except RunAborted as err:  # the run kept what it finished; the message says how to go on
        console.print(str(err), style="red", markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(err.exit_code) from None
