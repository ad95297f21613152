"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow (docs/observability.md#
experiment-trackers), ``logger=wandb``, ``logger=mlflow``, ``logger=[wandb,mlflow]``.

Rank 0 only. The tracker runs' ids are made once and kept in the run dir (``trackers.json``:
ids, modes, where the records are, never a key), so a requeued or resumed run continues the
same tracker run. A sweep's points share one W&B group / one MLflow experiment tag (the sweep
dir's name), their swept values logged as the run's config / params (hparams.json).

- W&B: offline (records under ``<run>/wandb``, ``wandb sync`` afterwards: the nodes of most
  clusters have no internet) unless ``tracker.offline=false``, or, with
  ``tracker.offline=null``, WANDB_API_KEY or WANDB_MODE=online in the job's environment.
  https://docs.wandb.ai/guides/technical-faq/setup/#can-i-run-wandb-offline
- MLflow: MLFLOW_TRACKING_URI when the job has one, else a file store (``<run>/mlruns``, a
  sweep's ``<sweep>/mlruns``), through MlflowClient (no global state).
  https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html

A script run with ``script=`` gets the ids in its environment (WANDB_RUN_ID, WANDB_RESUME,
WANDB_PROJECT, WANDB_MODE, WANDB_DIR, WANDB_RUN_GROUP; MLFLOW_TRACKING_URI, MLFLOW_RUN_ID,
MLFLOW_EXPERIMENT_NAME): its own ``wandb.init()`` / ``mlflow.start_run()`` continue the run.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp.config.loggers import trackers_of as wanted
from hpc_ddp.rundir import RunDir, read_json, write_json

log = logging.getLogger(__name__)

FILE = "trackers.json"
# The sweep's manifest beside a point's run dir (sweep/arrays.py's MANIFEST).
SWEEP_MANIFEST = "sweep.json"
# MLflow 3 refuses its file store unless this is set (it still reads and writes it).
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"


def offline(setting: bool | None, environ: Mapping[str, str]) -> bool:
    """W&B in offline mode: ``tracker.offline``, or (null) unless the job can log in."""
    if setting is not None:
        return setting
    mode = environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled"):
        return True
    return not (mode == "online" or environ.get("WANDB_API_KEY"))


def sweep_of(run: RunDir) -> Path | None:
    """The sweep dir a run dir is a point of (None for a run of its own)."""
    parent = run.root.parent
    return parent if (parent / SWEEP_MANIFEST).is_file() else None


def prepare(cfg: Any, run: RunDir, environ: MutableMapping[str, str]) -> dict[str, Any]:
    """Rank 0, at the start of every attempt: the record of the tracker runs (trackers.json),
    made on the first start and kept after: the same tracker runs from then on."""
    kinds = wanted(cfg.logger)
    record: dict[str, Any] = read_json(run.root / FILE) or {}
    sweep = sweep_of(run)
    group = sweep.name if sweep is not None else None
    project = cfg.tracker.project
    if "wandb" in kinds and "wandb" not in record:
        record["wandb"] = {"id": uuid.uuid4().hex[:12], "project": project, "group": group,
                           "offline": offline(cfg.tracker.offline, environ),
                           "dir": str(run.root)}
    if "mlflow" in kinds and "mlflow" not in record:
        uri = environ.get("MLFLOW_TRACKING_URI") or \
            f"file:{(sweep or run.root) / 'mlruns'}"
        record["mlflow"] = {"tracking_uri": _without_userinfo(uri), "experiment": project,
                            "group": group, "run_id": _mlflow_run(uri, project, run, group,
                                                                  environ)}
    if record:
        write_json(run.root / FILE, record)
    return record


def environment(record: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a script's own tracker calls read to continue the run's tracker runs."""
    found: dict[str, str] = {}
    if "wandb" in record:
        w = record["wandb"]
        found.update(WANDB_RUN_ID=w["id"], WANDB_RESUME="allow", WANDB_PROJECT=w["project"],
                     WANDB_DIR=w["dir"], WANDB_MODE="offline" if w["offline"] else "online")
        if w.get("group"):
            found["WANDB_RUN_GROUP"] = w["group"]
    if "mlflow" in record:
        m = record["mlflow"]
        found.update(MLFLOW_RUN_ID=m["run_id"], MLFLOW_EXPERIMENT_NAME=m["experiment"],
                     MLFLOW_TRACKING_URI=environ.get("MLFLOW_TRACKING_URI",
                                                     m["tracking_uri"]))
        if m["tracking_uri"].startswith("file:"):
            found[ALLOW_FILE_STORE] = "true"
    return found


def script_environment(cfg: Any, run: RunDir, environ: MutableMapping[str, str]
                       ) -> dict[str, str]:
    """Rank 0 of a script: its tracker runs prepared, their ids as variables (none without
    a tracker asked for)."""
    if not wanted(cfg.logger):
        return {}
    return environment(prepare(cfg, run, environ), environ)


class Trackers:
    """Rank 0's open tracker runs in the process that logs (the trainer's, an entry's, a
    script's hpc_ddp.context()): scalars as they are logged, the summary at the end."""

    def __init__(self, record: Mapping[str, Any], params: Mapping[str, Any],
                 label: str, environ: MutableMapping[str, str]) -> None:
        self.record = dict(record)
        self._wandb: Any = None
        self._mlflow: Any = None
        if "wandb" in record:
            self._wandb = _open_wandb(record["wandb"], params, label)
        if "mlflow" in record:
            _allow_file_store(record["mlflow"]["tracking_uri"], environ)
            from mlflow.tracking import MlflowClient  # deferred: mlflow

            uri = environ.get("MLFLOW_TRACKING_URI", record["mlflow"]["tracking_uri"])
            self._mlflow = MlflowClient(tracking_uri=uri)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """``values`` at ``step`` to every open tracker; one that fails is said once and
        closed (training goes on: TensorBoard has the values)."""
        try:
            self._log(step, values)
        except Exception as exc:
            log.warning("a tracker failed to log step %d (%s); it is closed, TensorBoard "
                        "goes on", step, exc)
            self._wandb = self._mlflow = None

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log(dict(values), step=step)
        if self._mlflow is not None:
            from mlflow.entities import Metric  # deferred: mlflow

            now = int(time.time() * 1000)
            self._mlflow.log_batch(self.record["mlflow"]["run_id"], metrics=[
                Metric(_mlflow_key(k), float(v), now, step) for k, v in values.items()])

    def close(self, finished: bool) -> list[str]:
        """Flush and close; ``finished``: the run has ended (not a stop or a requeue, after
        which the same tracker runs go on). Returns the lines that say where they are."""
        lines = []
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if finished else 1)
            self._wandb = None
            lines.append(where_wandb(self.record["wandb"]))
        if self._mlflow is not None:
            if finished:
                self._mlflow.set_terminated(self.record["mlflow"]["run_id"], "FINISHED")
            self._mlflow = None
            lines.append(where_mlflow(self.record["mlflow"]))
        return lines


def where_wandb(w: Mapping[str, Any]) -> str:
    """The W&B run, and for an offline one the command that uploads it."""
    if w["offline"]:
        return (f"W&B run {w['id']} (offline); upload it from a machine with internet: "
                f"wandb sync {shlex.quote(w['dir'])}/wandb/offline-run-*")
    return f"W&B run {w['id']} in project {w['project']}"


def where_mlflow(m: Mapping[str, Any]) -> str:
    uri = m["tracking_uri"]
    see = f"; see it with: mlflow ui --backend-store-uri {shlex.quote(uri)}" \
        if uri.startswith("file:") else ""
    return f"MLflow run {m['run_id']} in experiment {m['experiment']} at {uri}{see}"


def _open_wandb(w: Mapping[str, Any], params: Mapping[str, Any], label: str) -> Any:
    import wandb  # deferred: wandb

    # console="off": the rank's output is already captured (rank/join/output.py); W&B
    # wrapping stdout as well would duplicate it.
    return wandb.init(project=w["project"], id=w["id"], resume="allow", dir=w["dir"],
                      group=w.get("group"), name=label, config=dict(params),
                      mode="offline" if w["offline"] else "online",
                      settings=wandb.Settings(console="off", silent=True))


def _mlflow_run(uri: str, experiment: str, run: RunDir, group: str | None,
                environ: MutableMapping[str, str]) -> str:
    """A new MLflow run (its id): in ``experiment`` (made if missing), named after the run
    dir, tagged with its sweep, its swept values as params."""
    _allow_file_store(uri, environ)
    from mlflow.entities import Param  # deferred: mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for _ in range(5):  # a sweep's points may make the experiment at once
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            break
        try:
            client.create_experiment(experiment)
        except Exception:
            time.sleep(0.2)
    else:
        raise RuntimeError(f"MLflow experiment {experiment!r} could not be made at {uri}")
    tags = {"hpc_ddp.run_dir": str(run.root), **({"hpc_ddp.sweep": group} if group else {})}
    made = client.create_run(found.experiment_id, run_name=label_of(run), tags=tags)
    params = read_json(run.hparams) or {}
    if params:
        client.log_batch(made.info.run_id, params=[Param(str(k), str(v)[:500])
                                                   for k, v in params.items()])
    return str(made.info.run_id)


def _allow_file_store(uri: str, environ: MutableMapping[str, str]) -> None:
    """MLflow 3's file store, which it keeps behind a variable it reads from os.environ (in
    the rank, ``environ`` is os.environ; a test passes its own)."""
    if uri.startswith("file:"):
        environ.setdefault(ALLOW_FILE_STORE, "true")
        os.environ.setdefault(ALLOW_FILE_STORE, "true")


def label_of(run: RunDir) -> str:
    """The tracker run's name: the run dir's (a sweep point's with its sweep's)."""
    sweep = sweep_of(run)
    return f"{sweep.name}/{run.root.name}" if sweep is not None else run.root.name


def _mlflow_key(tag: str) -> str:
    # MLflow keys: alphanumerics, _ - . space / (its validation); a TensorBoard tag fits.
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in tag)


def _without_userinfo(uri: str) -> str:
    """A tracking URI without user:password@ (a secret; MLflow reads those from
    MLFLOW_TRACKING_USERNAME/PASSWORD too)."""
    scheme, sep, rest = uri.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return uri
    return f"{scheme}://{rest.split('@', 1)[1]}"
