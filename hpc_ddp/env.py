"""``python -m hpc_ddp.env``: build or update the environment the nodes activate.

    python -m hpc_ddp.env venv /shared/envs/train      # a venv from pyproject.toml's pins
    python -m hpc_ddp.env conda train                  # a conda env from environment.yml
    python -m hpc_ddp.env conda /shared/envs/train-c   # ... at a path

Run it on a login node, into a folder every node sees (or once on each node at the same
path); then submit with the override it prints (``cluster.venv=...`` or
``cluster.conda_env=...``), and every task activates the environment on its own node
(docs/containers.md). An existing environment is updated in place. The project installed
is this hpc_ddp checkout (editable, so the nodes import its sources), or ``--project DIR``.
Exit codes: 0 built, 1 a step failed (its output above says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_ddp.env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    venv = sub.add_parser("venv", help="a virtual environment (python -m venv + pip)")
    venv.add_argument("path", help="the venv's folder (absolute or relative to here)")
    venv.add_argument("--python", default=sys.executable,
                      help="the interpreter to make it from (default: this one)")
    venv.add_argument("--system-site-packages", action="store_true",
                      help="let it see that interpreter's packages (python -m venv's flag)")
    conda = sub.add_parser("conda", help="a conda environment from environment.yml")
    conda.add_argument("env", help="a name, or a folder (absolute, or starting with ./)")
    conda.add_argument("--file", default=None, help="default: the project's environment.yml")
    conda.add_argument("--conda", default=None,
                       help="conda's executable (default: $CONDA_EXE, else conda or mamba "
                       "on PATH)")
    for each in (venv, conda):
        each.add_argument("--project", default=None,
                          help="the project to install (a folder with pyproject.toml; "
                          "default: this hpc_ddp checkout)")
        each.add_argument("--extras", default="", help="its extras, e.g. timm or test,timm")
        each.add_argument("--offline", action="store_true",
                          help="no package index (login nodes without internet): pip takes "
                          "wheels from --find-links and builds with the env's own setuptools")
        each.add_argument("--find-links", default=None, metavar="DIR",
                          help="a folder of wheels for pip (with --offline: the only source)")
    return p


def project_dir(given: str | None) -> Path:
    """The folder whose pyproject.toml is installed."""
    folder = Path(given).expanduser().absolute() if given else Path(__file__).resolve(
    ).parents[1]
    if not (folder / "pyproject.toml").is_file():
        raise UserError("--project", str(folder), "has no pyproject.toml" + (
            "" if given else " (hpc_ddp is installed as a package, not a checkout)") + ".",
                        "give the folder of the project to install: --project DIR.")
    return folder


def target(project: Path, extras: str) -> str:
    return f"{project}[{extras}]" if extras else str(project)


def pip_options(offline: bool, find_links: str | None) -> list[str]:
    """pip install's options for where packages come from."""
    options = ["--no-index", "--no-build-isolation"] if offline else []
    return options + (["--find-links", str(Path(find_links).absolute())] if find_links else [])


def venv_steps(path: Path, python: str, project: Path, extras: str, system_site: bool,
               pip: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """(what, argv) for each step; the first is left out when the venv exists."""
    steps: list[tuple[str, list[str]]] = []
    inside = str(path / "bin" / "python")
    if not Path(inside).exists():
        steps.append((f"create the venv {path}", [python, "-m", "venv", str(path), *(
            ["--system-site-packages"] if system_site else [])]))
    steps.append((f"install {project.name} and its pinned dependencies (pyproject.toml)",
                  [inside, "-m", "pip", "install", *pip, "--editable",
                   target(project, extras)]))
    steps.append(("check that every requirement is met", [inside, "-m", "pip", "check"]))
    return steps


def find_conda(given: str | None, environ: dict[str, str]) -> str:
    for candidate in (given, environ.get("CONDA_EXE"), "conda", "mamba"):
        if candidate and shutil.which(candidate, path=environ.get("PATH")):
            return str(shutil.which(candidate, path=environ.get("PATH")))
    raise UserError("--conda", given or "conda", "no conda here (not on PATH, CONDA_EXE "
                    "unset)." if not given else "is not an executable.",
                    "install Miniforge (https://github.com/conda-forge/miniforge), `module "
                    "load` your site's conda, or build a venv: python -m hpc_ddp.env venv DIR.")


def conda_where(env: str) -> list[str]:
    """conda's option for the environment: a folder (-p) or a name (-n)."""
    if env.startswith(("/", "./", "../", "~")):
        return ["-p", str(Path(env).expanduser().absolute())]
    return ["-n", env]


def conda_exists(conda: str, env: str) -> bool:
    where = conda_where(env)
    if where[0] == "-p":
        return (Path(where[1]) / "conda-meta").is_dir()
    done = subprocess.run([conda, "env", "list", "--json"], capture_output=True, text=True,
                          check=False)
    try:
        envs = json.loads(done.stdout).get("envs", [])
    except ValueError:
        return False
    return any(Path(e).name == env for e in envs)


def conda_steps(conda: str, env: str, file: Path, project: Path, extras: str,
                exists: bool, pip: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    where = conda_where(env)
    make = (["env", "update", *where, "-f", str(file), "--prune"] if exists else
            ["env", "create", *where, "-f", str(file)])
    run = [conda, "run", *where]
    return [(f"{'update' if exists else 'create'} the conda env {env} from {file.name}",
             [conda, *make]),
            (f"install {project.name} (its pins came with {file.name})",
             [*run, "python", "-m", "pip", "install", *pip, "--no-deps", "--editable",
              target(project, extras)]),
            ("check that every requirement is met", [*run, "python", "-m", "pip", "check"])]


def run_steps(steps: list[tuple[str, list[str]]], out: TextIO) -> bool:
    """Each step in turn, its own output streamed; False at the first that fails."""
    began = time.monotonic()
    for number, (what, argv) in enumerate(steps, 1):
        print(f"[{number}/{len(steps)}] {what}: {' '.join(argv)}", file=out, flush=True)
        started = time.monotonic()
        done = subprocess.run(argv, check=False)
        if done.returncode != 0:
            print(f"[{number}/{len(steps)}] failed (exit code {done.returncode}) after "
                  f"{time.monotonic() - started:.0f}s", file=out, flush=True)
            return False
        print(f"[{number}/{len(steps)}] done in {time.monotonic() - started:.1f}s", file=out,
              flush=True)
    print(f"ready in {time.monotonic() - began:.0f}s", file=out, flush=True)
    return True


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        project = project_dir(args.project)
        pip = pip_options(args.offline, args.find_links)
        if args.kind == "venv":
            path = Path(args.path).expanduser().absolute()
            if path.exists() and not (path / "bin" / "python").exists():
                raise UserError("path", str(path), "exists and is not a venv (no "
                                "bin/python).", "give a new folder, or an existing venv.")
            steps = venv_steps(path, args.python, project, args.extras,
                               args.system_site_packages, pip)
            override = f"cluster.venv={path}"
        else:
            conda = find_conda(args.conda, dict(os.environ))
            file = Path(args.file).absolute() if args.file else project / "environment.yml"
            if not file.is_file():
                raise UserError("--file", str(file), "does not exist.",
                                "give the environment file: --file environment.yml.")
            steps = conda_steps(conda, args.env, file, project, args.extras,
                                conda_exists(conda, args.env), pip)
            override = f"cluster.conda_env={args.env}"
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if not run_steps(steps, out):
        return 1
    print(f"use it on every node with: {override}  (it must exist at that path on each "
          "node: a shared file system, or this command run on each)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
