"""The same software on every node: each rank's fingerprint, compared by rank 0 at the
rendezvous, before any process group or training step.

A fingerprint is Python's, torch's, CUDA's, NCCL's and cuDNN's versions and every installed
distribution (``importlib.metadata``: name and version), hashed to 16 hex digits. Each rank
puts the hash in its check-in record (rendezvous.connect). Rank 0 reads the records (it
reads them for the summary anyway), and when they differ it asks only one rank per odd hash
(and one of the majority) for its whole fingerprint, names the nodes and the packages that
differ, and tells every rank the verdict through one store key, as the run-dir claim does
(join.claim_run_dir). Per rank: one hash, two store reads, one write if asked: O(1).

Cost: the distributions come from their folders' names (one listing per sys.path entry, no
file read): 1.2-4.6 ms per process for the ~100 of this repo's .venv, against 51 ms through
importlib.metadata (measured here, the same 102 names and versions); the versions add ~11 ms
(cuDNN's library is loaded). Once per rank at start.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import hostlist  # python-hostlist: node3,node4 -> node[3-4]

from hpc_ddp.rank.join.distenv import DistEnv

log = logging.getLogger(__name__)

# The key every rank's check-in record carries its hash under.
RECORD_KEY = "env"
_ASK = "hpc_ddp/env/ask"
_DETAIL = "hpc_ddp/env/detail/"
_VERDICT = "hpc_ddp/env/verdict"
_READ = "hpc_ddp/env/read"
_ALL_READ = "hpc_ddp/env/all_read"
# Nodes and packages named in one message at most (the rest are counted).
_SHOWN = 8
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "cudnn")


class EnvironmentMismatch(RuntimeError):
    """The nodes' software differs (rank 0's message names the nodes and the packages)."""


@dataclass(frozen=True)
class Fingerprint:
    versions: dict[str, str | None]
    packages: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        text = json.dumps([self.versions, sorted(self.packages.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """What summary.json records (the packages by count and hash, not one by one)."""
        return {**self.versions, "packages": len(self.packages), "hash": self.digest}


def versions(load: bool = True) -> dict[str, str | None]:
    """Python's, torch's, CUDA's (torch's build), NCCL's and cuDNN's versions; without
    ``load`` (a supervisor, which imports no torch) torch's and CUDA's read from torch's
    version.py and NCCL's and cuDNN's left to the training process (their packages'
    versions are in :func:`installed` either way)."""
    if not load:
        return {"python": platform.python_version(), **_torch_build(),
                "nccl": None, "cudnn": None}
    import torch  # deferred: torch

    try:
        nccl: str | None = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL
        nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl,
            "cudnn": str(cudnn) if cudnn is not None else None}


def installed(path: list[str] | None = None) -> dict[str, str]:
    """Every distribution this interpreter sees (``sys.path``), by normalised name, the first
    on the path winning as for imports. Read from the folder names installers write
    (``name-version.dist-info``, PEP 427/491): one listing per path entry, no file opened,
    so 8,000 ranks do not read 8,000 x N METADATA files off a shared file system; a name
    without a version falls back to its metadata."""
    import importlib.metadata  # deferred: importlib.metadata

    found: dict[str, str] = {}
    for entry in sys.path if path is None else path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            stem, dot, kind = name.rpartition(".")
            if kind not in ("dist-info", "egg-info") or not dot:
                continue
            project, _, version = stem.partition("-")
            if kind == "egg-info":  # name-1.0-py3.11.egg-info
                version = version.split("-py")[0]
            if not version:
                try:
                    version = importlib.metadata.PathDistribution(
                        Path(entry or ".") / name).version or ""
                except (OSError, ValueError):
                    continue
            if version:
                found.setdefault(_normal(project), version)
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _torch_build() -> dict[str, str | None]:
    """torch's version and its CUDA build's, as torch/version.py (which torch writes when it
    is built) says them, read as text: nothing of torch is loaded."""
    found: dict[str, str | None] = {"torch": None, "cuda": None}
    try:
        spec = importlib.util.find_spec("torch")
        where = spec.submodule_search_locations if spec is not None else None
        text = (Path(list(where)[0]) / "version.py").read_text() if where else ""
    except (OSError, ImportError, ValueError):
        return found
    for key, name in (("torch", "__version__"), ("cuda", "cuda")):
        match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        found[key] = match[1] if match else None
    return found


def fingerprint(load: bool = True) -> Fingerprint:
    """This interpreter's software (``load`` false: without importing torch, see versions)."""
    return Fingerprint(versions(load), installed())


def differences(odd: Fingerprint, reference: Fingerprint) -> list[str]:
    """"torch 2.3.0 (others 2.4.1)", "fake-pkg 1.0 (others: none)", "numpy: none (others
    2.1.0)": what ``odd`` has that ``reference`` has not."""
    found = [f"{key} {odd.versions.get(key)} (others {reference.versions.get(key)})"
             for key in VERSION_KEYS if odd.versions.get(key) != reference.versions.get(key)]
    for name in sorted(set(odd.packages) | set(reference.packages)):
        mine, theirs = odd.packages.get(name), reference.packages.get(name)
        if mine != theirs:
            found.append(f"{name} {mine or 'not installed'} (others "
                         f"{theirs or 'not installed'})")
    return found


def check(store: Any, env: DistEnv, mine: Fingerprint, placed: list[dict[str, Any]] | None,
          allow_mixed: bool, timeout_s: float) -> list[str]:
    """Compare the ranks' fingerprints (every rank calls it; ``placed``: the check-in
    records, rank 0 only). Returns the differences found (empty: all the same); raises
    EnvironmentMismatch on rank 0 and SystemExit(1) elsewhere unless ``allow_mixed``."""
    if env.world_size == 1:
        return []
    if env.is_master:
        assert placed is not None
        verdict = _judge(store, env, mine, placed, timeout_s)
        store.set(_VERDICT, json.dumps(verdict))
        problems = verdict["problems"]
        if problems and not allow_mixed:
            _wait(store, _ALL_READ, min(timeout_s, 30))  # the others read it before we go
            raise EnvironmentMismatch(verdict["message"])
        if problems:
            log.warning("%s (cluster.allow_mixed_env=true: training anyway)", verdict["message"])
        return list(problems)
    asked = json.loads(bytes(store.get(_ASK)).decode())
    if env.rank in asked:
        store.set(f"{_DETAIL}{env.rank}", json.dumps([mine.versions, mine.packages]))
    verdict = json.loads(bytes(store.get(_VERDICT)).decode())
    if verdict["problems"] and not allow_mixed:
        log.error("%s", verdict["message"])
        if int(store.add(_READ, 1)) == env.world_size - 1:
            store.set(_ALL_READ, "1")
        raise SystemExit(1)  # rank 0 reports it (its error file), this rank only logs it
    return list(verdict["problems"])


def _judge(store: Any, env: DistEnv, mine: Fingerprint, placed: list[dict[str, Any]],
           timeout_s: float) -> dict[str, Any]:
    """Rank 0: which ranks differ from the majority, and in what."""
    by_hash: dict[str, list[dict[str, Any]]] = {}
    for record in placed:
        by_hash.setdefault(str(record.get(RECORD_KEY)), []).append(record)
    if len(by_hash) == 1:
        store.set(_ASK, "[]")
        return {"problems": [], "message": ""}
    # The reference: the most common fingerprint (rank 0's on a tie).
    reference = max(by_hash, key=lambda h: (len(by_hash[h]), h == mine.digest))
    odd = [h for h in by_hash if h != reference]
    wanted = {h: int(by_hash[h][0]["rank"]) for h in [reference, *odd]}
    asked = [r for r in wanted.values() if r != 0]
    store.set(_ASK, json.dumps(asked))
    details = {0: mine}
    for rank in asked:
        key = f"{_DETAIL}{rank}"
        if _wait(store, key, timeout_s):
            versions_, packages = json.loads(bytes(store.get(key)).decode())
            details[rank] = Fingerprint(versions_, packages)
    ref = details.get(wanted[reference])
    problems, lines, odd_hosts = [], [], []
    for h in odd:
        hosts = list(dict.fromkeys(str(r.get("host")) for r in by_hash[h]))
        odd_hosts += hosts
        ranks = [int(r["rank"]) for r in by_hash[h]]
        got = details.get(wanted[h])
        diff = differences(got, ref) if got is not None and ref is not None else [
            "(the details did not arrive)"]
        shown = ", ".join(hosts[:_SHOWN]) + (f" and {len(hosts) - _SHOWN} more"
                                              if len(hosts) > _SHOWN else "")
        what = "; ".join(diff[:_SHOWN]) + (f"; and {len(diff) - _SHOWN} more"
                                           if len(diff) > _SHOWN else "")
        lines.append(f"node(s) {shown} ({len(ranks)} rank(s), e.g. rank {ranks[0]}): {what}")
        problems += [f"{host}: {d}" for host in hosts[:_SHOWN] for d in diff[:_SHOWN]]
    majority = len({str(r.get("host")) for r in by_hash[reference]})
    exclude = hostlist.collect_hostlist(list(dict.fromkeys(odd_hosts)))
    message = (f"the software differs between the job's nodes (checked before training; "
               f"compared with the {majority} node(s) most have in common): "
               + " | ".join(lines) + ". Fix the environment on those nodes (python -m "
               "hpc_ddp.env builds one from environment.yml; a container pins it), leave them "
               f"out (cluster.exclude={exclude}), or set cluster.allow_mixed_env=true to "
               "train anyway.")
    return {"problems": problems, "message": message}


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except RuntimeError:  # timed out, or the store is gone
        return False


def read_pins(path: Any) -> dict[str, str]:
    """The versions an environment.yml pins: conda's ``python=3.11``, pip's ``torch==2.4.1``
    (names normalised; entries without a version are left out)."""
    import yaml  # deferred: yaml

    data = yaml.safe_load(path.read_text()) or {}
    pins: dict[str, str] = {}
    for dep in data.get("dependencies", []):
        specs = dep.get("pip", []) if isinstance(dep, dict) else [dep]
        for spec in specs:
            found = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==?\s*([^\s,;]+)", str(spec))
            if found:
                pins[_normal(found.group(1))] = found.group(2)
    return pins


def drift(pins: dict[str, str], software: Fingerprint) -> list[str]:
    """How this interpreter differs from ``pins``: "torch 2.3.0 (environment.yml: 2.4.1)".
    A pin matches a version it begins (python=3.11 and 3.11.7) or equals but for a local
    suffix (torch==2.4.1 and 2.4.1+cu121)."""
    found = []
    for name, want in sorted(pins.items()):
        have = software.versions.get("python") if name == "python" else software.packages.get(
            name)
        plain = (have or "").split("+")[0]
        if have is None or not (plain == want or plain.startswith(want + ".")):
            found.append(f"{name} {have or 'not installed'} (environment.yml: {want})")
    return found
