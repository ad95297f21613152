"""Stand-ins for pyxis' srun options and ``apptainer exec``, which cannot be installed here.

Each one checks its command line against the runtime's documented syntax, records it (one
JSON file per task), and then does what the real one would do in the part that matters for
the run, outside any container: it runs the command. Sources: pyxis' option table
(https://github.com/NVIDIA/pyxis/blob/master/args.c, the wiki's Usage page) and Apptainer's
exec flags (https://apptainer.org/docs/user/main/cli/apptainer_exec.html,
cmd/internal/cli/action_flags.go). What this proves: hpc_ddp writes command lines of that
shape, and a job started through them trains. What it does not: the runtimes themselves.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

# pyxis' srun options: name -> takes an argument (args.c, spank_opts).
PYXIS = {"container-image": True, "container-mounts": True, "container-workdir": True,
         "container-name": True, "container-save": True, "container-mount-home": False,
         "no-container-mount-home": False, "container-remap-root": False,
         "no-container-remap-root": False, "container-entrypoint": False,
         "no-container-entrypoint": False, "container-entrypoint-log": False,
         "container-writable": False, "container-readonly": False, "container-env": True,
         "container-unshare": True}
# srun's own options that take their value as the next word (submitit writes --output X).
SRUN_VALUED = {"--output", "--error", "--input", "-o", "-e", "-i", "-N", "-n", "-c", "-p",
               "-w", "-x", "-J", "-t"}
# apptainer exec's options that hpc_ddp may write, and whether they take an argument.
APPTAINER = {"--nv": False, "--nvccli": False, "--rocm": False, "--cleanenv": False,
             "-e": False, "--containall": False, "-C": False, "--contain": False,
             "--writable-tmpfs": False, "--no-home": False, "--bind": True, "-B": True,
             "--pwd": True, "--cwd": True, "--env": True, "--home": True, "--overlay": True}


class Refused(ValueError):
    pass


def parse_pyxis(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """srun's argv -> (pyxis options, the rest for the real srun); Refused when malformed."""
    found: dict[str, str | bool] = {}
    rest: list[str] = []
    words = list(argv)
    while words:
        word = words.pop(0)
        name, eq, value = word.removeprefix("--").partition("=")
        if not word.startswith("--") or name not in PYXIS:
            if not word.startswith("-"):  # the command: everything from here is its own
                rest += [word, *words]
                break
            rest.append(word)
            if word in SRUN_VALUED and words:
                rest.append(words.pop(0))
            continue
        if PYXIS[name] and not eq:
            if not words:
                raise Refused(f"--{name} needs an argument")
            value = words.pop(0)
        if PYXIS[name] and not value:
            raise Refused(f"--{name}: argument required")
        if not PYXIS[name] and eq:
            raise Refused(f"--{name} takes no argument")
        if name in found:
            raise Refused(f"--{name} given twice")
        found[name] = value if PYXIS[name] else True
    if "container-image" not in found and found:
        raise Refused("--container-* options without --container-image")
    for entry in str(found.get("container-mounts", "")).split(",") if found.get(
            "container-mounts") else []:
        parts = entry.split(":", 2)
        if not parts[0] or (len(parts) > 1 and not parts[1]):
            raise Refused(f"--container-mounts: invalid format: {entry}")
        if len(parts) == 3 and not re.fullmatch(r"[a-z_=]+(\+[a-z_=]+)*", parts[2]):
            raise Refused(f"--container-mounts: flags must be joined with +: {entry}")
    name = str(found.get("container-name", ""))
    if name and name.partition(":")[2] not in ("", "auto", "create", "exec", "no_exec"):
        raise Refused(f"--container-name: unknown flag in {name}")
    return found, rest


def parse_apptainer(argv: list[str]) -> tuple[dict[str, list[str]], str, list[str]]:
    """``exec [options] IMAGE CMD...`` -> (options, image, command); Refused when malformed."""
    if not argv or argv[0] != "exec":
        raise Refused(f"expected `apptainer exec`, got {argv[:1]}")
    options: dict[str, list[str]] = {}
    words = argv[1:]
    while words and words[0].startswith("-"):
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        if flag not in APPTAINER:
            raise Refused(f"unknown option {flag}")
        if APPTAINER[flag] and not eq:
            if not words:
                raise Refused(f"{flag} needs an argument")
            value = words.pop(0)
        options.setdefault(flag, []).append(value)
    if len(words) < 2:
        raise Refused("no image, or no command after it")
    for spec in options.get("--bind", []) + options.get("-B", []):
        for one in spec.split(","):
            parts = one.split(":")
            if len(parts) > 3 or not parts[0] or (len(parts) == 3 and parts[2] not in
                                                    ("ro", "rw")):
                raise Refused(f"--bind spec is src[:dest[:ro|rw]]: {one}")
    for item in options.get("--env", []):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", item):
            raise Refused(f"--env takes NAME=VALUE: {item}")
    return options, words[0], words[1:]


def _record(folder: str, what: str, argv: list[str]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    job, task = os.environ.get("SLURM_JOB_ID", "x"), os.environ.get("SLURM_PROCID", os.getpid())
    name = f"{what}-{job}-{task}"
    Path(folder, name + ".json").write_text(json.dumps(argv))


def srun(argv: list[str], folder: str, real: str) -> None:
    """The batch script's srun: check and record pyxis' options, run the real srun without
    them (the working directory as --chdir, the variables --container-env names as they
    are: the job's environment already holds them)."""
    try:
        found, rest = parse_pyxis(argv)
    except Refused as exc:
        sys.exit(f"pyxis stand-in: {exc}")
    _record(folder, "srun", argv)
    chdir = [f"--chdir={found['container-workdir']}"] if "container-workdir" in found else []
    os.execv(real, [real, *chdir, *rest])


def apptainer(argv: list[str], folder: str) -> None:
    try:
        options, image, command = parse_apptainer(argv)
    except Refused as exc:
        sys.exit(f"apptainer stand-in: {exc}")
    if not Path(image).is_file():
        sys.exit(f"apptainer stand-in: no image {image}")
    _record(folder, "apptainer", argv)
    for item in options.get("--env", []):
        name, _, value = item.partition("=")
        os.environ[name] = value
    if "--pwd" in options:
        os.chdir(options["--pwd"][-1])
    os.execvp(command[0], command)


def write(bin_dir: Path, record_dir: Path, repo: Path) -> None:
    """Executables ``srun`` and ``apptainer`` in ``bin_dir`` that record into ``record_dir``."""
    import shutil

    bin_dir.mkdir(parents=True, exist_ok=True)
    real = shutil.which("srun")
    for name, call in (("srun", f"srun(sys.argv[1:], {str(record_dir)!r}, {real!r})"),
                       ("apptainer", f"apptainer(sys.argv[1:], {str(record_dir)!r})")):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(repo)!r})\n"
                        f"from tests.cluster.standins import {name}\n{call}\n")
        path.chmod(0o755)
