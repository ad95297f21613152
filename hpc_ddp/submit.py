"""Submit a DDP training run: ``python -m hpc_ddp.submit [key=value ...]``.

    python -m hpc_ddp.submit                                   # local, 2 ranks, synthetic data
    python -m hpc_ddp.submit cluster=slurm nodes=4 cluster.partition=gpu
    python -m hpc_ddp.submit run_dir=outputs/try1 resume=true trainer.max_steps=500
    python -m hpc_ddp.submit cluster=slurm nodes=4 dry_run=true  # print the sbatch script
    python -m hpc_ddp.submit cluster=slurm nodes=4 preflight=true # doctor first, then train
    python -m hpc_ddp.submit --cfg                              # print the resolved config
    python -m hpc_ddp.submit -m optim.lr=0.1,0.01 model=tiny_cnn,resnet18   # a sweep
    python -m hpc_ddp.submit --config-dir conf model=mynet      # your config folder first
    python -m hpc_ddp.submit entry=my_pkg.train:main nodes=4    # your loop, with a context
    python -m hpc_ddp.submit script=train.py nodes=4 -- --epochs 3   # your torchrun script

Overrides use Hydra's grammar over the groups in conf/ (docs/configuration.md).
--config-dir DIR (or -cd DIR) searches DIR before hpc_ddp's conf/; everything after `--` is
passed to script= unchanged (docs/your-code.md). Bad input exits with code 2 and one line
naming the key, the value and the fix. This command is a thin layer over the Python API
(hpc_ddp.plan / hpc_ddp.submit, docs/api.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import types
from collections.abc import Sequence
from typing import Any, TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.inputs.command_line import split_script_args, take_config_dir
from hpc_ddp.launch import interrupts
from hpc_ddp.launch.interrupts import exit_code
from hpc_ddp.remote import intent


def handle_stop_signals() -> None:
    """Ctrl-C, a `kill`, a closed terminal all end a followed run the same way: a local run
    checkpoints and stops, a Slurm job goes on; a copy of the signal that arrives with it
    (a wrapper's) is the same Ctrl-C (launch/interrupts.py)."""
    interrupts.install()


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--args-stdin"]:  # sent by a laptop over SSH (remote/submit_remote.py)
        args = args_from_stdin(sys.stdin)
    elif argv is None:
        restart_without_secrets(args)
    if argv is None:  # the command, not a call from Python: signals are ours to handle
        handle_stop_signals()
    if any(a in ("-h", "--help") for a in args):
        print(__doc__, file=out)
        return 0
    try:
        return _main(args, out)
    except KeyboardInterrupt as exc:  # before anything went out (after: _submit says what did)
        print(f"\nstopped ({interrupts.name(exc)}) before anything was submitted: nothing "
              "runs.", file=sys.stderr)
        return exit_code(exc)


# Set in the command's own restart (restart_without_secrets): it is not done twice.
_RESTARTED_ENV = "HPC_DDP_ARGV_SCRUBBED"


def restart_without_secrets(args: list[str]) -> None:
    """A secret typed on the command line (``model.api_token=...``, ``-- --hf-token ...``)
    stays in this process's argv, which every user of the machine reads in ps for as long as
    the command runs (a followed local run: the whole run). The command then starts itself
    again at once with each such value replaced by the reference the run keeps anyway
    (``${oc.env:HPC_DDP_SECRET_...}``; each value of a swept one by its own,
    ``..._0``, ``..._1``), the value in its environment (config/secrets.py)."""
    if os.environ.get(_RESTARTED_ENV):
        return
    argv, values = argv_without_secrets(args)
    if argv is not None:
        os.execve(sys.executable, argv, {**os.environ, **values, _RESTARTED_ENV: "1"})


def argv_without_secrets(args: list[str]) -> tuple[list[str] | None, dict[str, str]]:
    """The command line :func:`restart_without_secrets` starts again with and the values
    its environment carries; None where no secret literal can be taken out of ``args``."""
    # deferred (start-up): config.secrets, config.secret_channels
    from hpc_ddp.config import secrets
    from hpc_ddp.config.secret_channels import Found, scrub_script_args

    try:
        overrides, script_args = split_script_args(args)
        # strict: two values for one variable (HF_TOKEN in two sections) are left as given,
        # for the run's own check to refuse, never sent as one value for both
        found = Found(secrets.NO_MARKS)
        clean = [secrets.scrub_override(a, found) if "=" in a and not a.startswith("-")
                 else a for a in overrides]
        scrubbed = None if script_args is None else scrub_script_args(script_args, found)
    except (UserError, ValueError):
        return None, {}  # compose() refuses what cannot be read, its secrets masked
    # **** stands for what cannot be read or passed by reference (a range over a secret's
    # name): compose() refuses or reads it as given; a line that changed nothing is kept.
    masked_only = any(c != o and secrets.MASK in c for c, o in zip(clean, overrides, strict=True))
    if masked_only or (clean == overrides and scrubbed == script_args):
        return None, {}
    return [sys.executable, "-m", "hpc_ddp.submit", *clean,
            *(["--", *scrubbed] if scrubbed is not None else [])], found.values


# Set when a laptop sent the command (args_from_stdin): the laptop prints the lines that
# follow a submission, with its own handle's paths, not this machine's.
FROM_LAPTOP: list[bool] = []


def args_from_stdin(stdin: TextIO) -> list[str]:
    """The command line a laptop sent on the connection's standard input (never on a command
    line: it may reference secrets, whose values come with it and are put in this process's
    environment, as a typed secret is: restart_without_secrets)."""
    sent = json.loads(stdin.readline() or "{}")
    # The laptop keeps the input open: at its end (or its silence) this command ends, and
    # nothing of ours lingers on the login node (remote/tether.py).
    from hpc_ddp.remote import tether  # deferred (start-up): remote.tether

    with contextlib.suppress(OSError, ValueError):  # no descriptor (a call from Python)
        tether.hold(stdin.fileno())
    FROM_LAPTOP.append(True)
    # Run as ``python -P``: hpc_ddp came from its install, never from a folder in the copy
    # of the project; the project's own modules are found from here on, as under ``-m``.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ.update({str(k): str(v) for k, v in (sent.get("env") or {}).items()})
    script_args = sent.get("script_args")
    return [*(["-m"] if sent.get("multirun") else []), *map(str, sent.get("args") or []),
            *(["--", *map(str, script_args)] if script_args is not None else [])]


def _main(args: list[str], out: TextIO) -> int:
    try:
        args, script_args = split_script_args(args)
        args = take_config_dir(args)
        show_cfg = "--cfg" in args
        check_cfg_flag(args)
        multirun = "-m" in args or "--multirun" in args
        overrides = [a for a in args if a not in ("--cfg", "-m", "--multirun")]
        unknown = [a for a in overrides if a.startswith("-")]
        if unknown:
            raise UserError("option", unknown[0], "is not an option of this command.",
                            "pass key=value overrides; see --help.")
        if not show_cfg and intent.wanted(overrides):
            # deferred (start-up): remote.submit_remote
            from hpc_ddp.remote import submit_remote

            return submit_remote.submit(overrides, script_args, multirun, out).status
        if multirun:
            # deferred: the typed schemas
            from hpc_ddp.sweep.launch import launch

            return launch(overrides, out, show_cfg=show_cfg, script_args=script_args)
        return _submit(overrides, show_cfg, out, script_args)
    except UserError as exc:
        print(f"error: {_masked(exc.message, args)}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except BrokenPipeError:  # `... --cfg | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# Hydra's --cfg takes which config to print (job, hydra, all); ours prints the resolved one.
_HYDRA_CFG_VALUES = ("job", "hydra", "all")


def check_cfg_flag(args: Sequence[str]) -> None:
    """``--cfg job`` (a Hydra habit) is refused with the fix, not read as an override."""
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--cfg=") else (
            args[i + 1] if arg == "--cfg" and i + 1 < len(args) else None)
        if arg.startswith("--cfg=") or value in _HYDRA_CFG_VALUES:
            raise UserError("--cfg", value, "takes no argument here: it prints the resolved "
                            "config (Hydra's job config, with the derived values filled in).",
                            "write --cfg alone, e.g. python -m hpc_ddp.submit model=resnet18 "
                            "--cfg.")


def _masked(text: str, args: Sequence[str]) -> str:
    """``text`` with the secret literals of ``args`` (each value of a swept one too), the
    values of this environment's secret-named variables, and the value of any secret NAME=
    in it, however short (``comment=token=x``), as **** (config/secrets.py)."""
    # deferred (start-up): config.secrets
    from hpc_ddp.config import secrets

    try:
        given = secrets.literals_in(list(args))
    except UserError:
        given = []
    return secrets.mask_assigned(secrets.mask(text, secrets.values_to_mask(os.environ, given)))


def _submit(overrides: list[str], show_cfg: bool, out: TextIO,
            script_args: list[str] | None = None) -> int:
    # deferred: the typed schemas; start-up: config.nccl_schema
    from hpc_ddp import api
    from hpc_ddp.config.compose import to_yaml
    from hpc_ddp.config.nccl_schema import nccl_warnings

    chosen = api.plan(overrides, script_args=script_args, check=not show_cfg)
    cfg, run_dir = chosen.cfg, chosen.run_dir
    if show_cfg:
        print(to_yaml(cfg), file=out, end="")
        return 0
    for warning in nccl_warnings(cfg.nccl):
        print(f"warning: {warning}", file=sys.stderr)
    # deferred (start-up): config.secrets
    from hpc_ddp.config.secrets import referenced

    for name in referenced(cfg):
        if name not in os.environ and name not in chosen.secrets:
            print(f"warning: {name} is passed as ${{oc.env:{name}}} but is not set here; the "
                  "job gets it only where its nodes set it (export it before submitting, "
                  "and before a resume: its value is kept nowhere).", file=sys.stderr)
    # deferred (start-up): config.schema (launch.container)
    from hpc_ddp.launch.container import unmounted

    for path in unmounted(cfg, run_dir.root):
        print(f"warning: {path} (an argument of {cfg.script}) is under no mount of the "
              f"{cfg.cluster.container.kind} container: what the script writes there is lost "
              "with the container. Fix: a path under the run dir or the folder you submit "
              "from, or add its folder to cluster.container.mounts "
              "(docs/containers.md).", file=sys.stderr)
    launcher = api.target(cfg)
    if cfg.dry_run:
        print(launcher.dry_run(cfg, run_dir), file=out)
        return 0
    if cfg.preflight:
        # deferred: hostlist, the typed schemas
        from hpc_ddp.doctor import preflight

        if not preflight(cfg, run_dir, out):
            print("error: the preflight checks failed (above); nothing was submitted.",
                  file=sys.stderr)
            return 1
    # A stop signal while the job goes out waits until it is out (and said): then it is
    # handled as one while following, so the command never stops not knowing what it sent.
    run = None
    try:
        with interrupts.held():
            run = api.submit(chosen)
            why = f": {chosen.why}" if cfg.cluster.kind == "local" and chosen.why else ""
            print(f"hpc_ddp: {cfg.cluster.kind} job {run.job_id}: {launcher.describe(cfg)}"
                  f"{why}\n"
                  f"  run dir:     {run_dir.root}\n"
                  f"  rank-0 log:  {run_dir.rank_log(0)}\n"
                  f"  tensorboard: tensorboard --logdir {shlex.quote(str(run_dir.tb))}",
                  file=out, flush=True)
        if not cfg.wait:
            for line in [] if FROM_LAPTOP else next_steps(cfg.cluster.kind, run_dir.root,
                                                          run.job_id, cfg.detach):
                print(line, file=out, flush=True)
            return 0
        run.wait(out=out)
    except api.RunFailed:
        return 1  # follow() has printed the failing rank's lines
    except KeyboardInterrupt as exc:
        if run is None:  # not submitted (the Python API's caller interrupted it)
            raise
        return interrupted(run, out, exc)
    return 0


def next_steps(kind: str, root: Any, job_id: str, detach: bool = False) -> list[str]:
    """What follows a run that was submitted without wait=true (with it, the command does)."""
    where = shlex.quote(str(root))
    if detach:
        return ["  detached:    the ranks run in a session of their own; closing this "
                "terminal or logging out does not stop them",
                f"  follow:      python -m hpc_ddp.logs {where} --follow",
                f"  status:      python -m hpc_ddp.status {where} --watch",
                f"  stop:        python -m hpc_ddp.status {where} --stop   (a checkpoint, "
                "then the resume line)"]
    if kind != "slurm":
        return [f"  status:      python -m hpc_ddp.status {where}"]
    return [f"  follow:      python -m hpc_ddp.status {where} --watch",
            f"               (in Python: hpc_ddp.Run.from_dir({str(root)!r}).wait(); "
            f"squeue -j {job_id})"]


def interrupted(run: Any, out: TextIO, exc: KeyboardInterrupt) -> int:
    """Ctrl-C (or SIGTERM/SIGHUP) while following: a Slurm job goes on; a local run
    checkpoints and stops, or, on a second Ctrl-C a second or more later, is stopped at once.
    Exit code 128 + the signal, as a shell reports it."""
    code = exit_code(exc)
    where = shlex.quote(str(run.run_dir))
    if run.kind == "slurm":
        print(f"\nstopped following; job {run.job_id} goes on (python -m hpc_ddp.status "
              f"{where}; scancel {run.job_id} stops it).", file=out, flush=True)
        return code
    print("\ninterrupted: the ranks save a checkpoint and stop (Ctrl-C again, a second or "
          "more later, stops them at once, losing the steps since the last checkpoint)...",
          file=out, flush=True)
    killed = False
    try:
        with interrupts.second_stops_at_once():
            run.cancel(grace_s=120.0)
    except KeyboardInterrupt:
        killed = True
    if killed:  # outside the block: nothing interrupts the kill
        run.cancel(grace_s=0.0)
    # deferred (start-up): rundir
    from hpc_ddp.rundir import resume_command
    from hpc_ddp.watch.follow import stopped_how  # deferred (start-up): follow

    print(f"{stopped_how(run.files, killed)} Continue with: {resume_command(run.run_dir)}",
          file=out, flush=True)
    return code


class _SubmitModule(types.ModuleType):
    """This module is also the API's ``hpc_ddp.submit``: importing it makes Python set the
    package's ``submit`` attribute to the module, which would otherwise shadow the function
    (``import hpc_ddp.submit; hpc_ddp.submit([...])`` failing with "module not callable")."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # deferred: the typed schemas
        from hpc_ddp.api import submit

        return submit(*args, **kwargs)


sys.modules[__name__].__class__ = _SubmitModule

if __name__ == "__main__":
    sys.exit(main())
