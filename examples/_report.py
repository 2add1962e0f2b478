"""What the examples record besides their log lines: their metrics (JSON, also the benchmarks' --json),
the per-step losses and times of one or both engines (CSV), the picture of both engines' loss curves
(``--compare``, matplotlib), and one MLflow run per engine in a local store (``--mlflow``). matplotlib
and MLflow are imported only when asked for."""
from __future__ import annotations

import csv
import importlib
import json
import math
import os
import statistics
import time
from pathlib import Path

from examples._cli import add_option

EXAMPLES_EXTRA = "pip install -e '.[examples]'"
MLFLOW_BATCH = 1000   # MLflow takes at most 1000 metrics per log_batch call


def write_steps_csv(path, runs, unit):
    """``runs``: {engine: {"loss": [...], "ms": [...]}}, one entry per step; CSV rows
    ``engine, <unit>, loss, ms``, steps counted from 1."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["engine", unit, "loss", "ms"])
        for engine, steps in runs.items():
            writer.writerows([engine, step, loss, ms]
                             for step, (loss, ms) in enumerate(zip(steps["loss"], steps["ms"]), start=1))


def write_json(path, data):
    """``data`` as indented JSON in ``path`` (its folder made first); nothing when ``path`` is None or ''.
    The examples' --json and metrics.json, and the benchmarks' --json."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


def add_report_options(parser, engines, unit, summary):
    """--compare and --mlflow, worded for the example's engines, step unit and evaluation."""
    add_option(parser, "compare", type=Path, metavar="PNG", help=f"train with {engines} on the same batches, then "
               f"draw their per-{unit} losses into this PNG (needs matplotlib) and write them to the same name "
               f"with .csv")
    add_option(parser, "mlflow", action="store_true", help=f"log each engine's run (ms/{unit}, loss, ppl by {unit}; "
               f"{summary}) to MLflow: ./mlruns, or MLFLOW_TRACKING_URI (needs mlflow-skinny)")


def _imported(module, needs, pip):
    """``module``, or a SystemExit saying which flag ``needs`` it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"error: {needs}, which is not installed: {pip} (or {EXAMPLES_EXTRA})") from exc


def matplotlib_figure():
    """matplotlib's Figure class (no pyplot, no global backend)."""
    figure = _imported("matplotlib.figure", "--compare draws its picture with matplotlib", "pip install matplotlib")
    return figure.Figure


def import_mlflow():
    return _imported("mlflow", "--mlflow needs MLflow", "pip install mlflow-skinny")


def check_report_packages(args):
    """Before any training: --compare needs matplotlib, --mlflow needs MLflow."""
    if args.compare:
        matplotlib_figure()
    if args.mlflow:
        import_mlflow()


def plot_losses(path, runs, title, unit):
    """A PNG of each engine's training loss by step, the median step time in the legend."""
    figure = matplotlib_figure()(figsize=(6.4, 3.6), dpi=100)
    axes = figure.subplots()
    for (engine, steps), style in zip(runs.items(), ("-", "--", ":", "-.")):
        axes.plot(range(1, len(steps["loss"]) + 1), steps["loss"], style, linewidth=1.2,
                  label=f"{engine} (median {statistics.median(steps['ms']):.0f} ms/{unit})")
    axes.set(xlabel=unit, ylabel="training loss", title=title)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def log_mlflow(experiment, engine, params, steps, unit, summary):
    """One MLflow run named after the engine in ``experiment``: the flags as parameters, ``loss``,
    ``ppl`` and ``ms_per_<unit>`` at every step, and ``summary`` (evaluation) at the last step. The
    store is ``MLFLOW_TRACKING_URI``, else ``./mlruns`` (a local folder: no server)."""
    mlflow = import_mlflow()
    from mlflow.entities import Metric
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps the folder store behind it
        mlflow.set_tracking_uri(Path("mlruns").resolve().as_uri())
    mlflow.set_experiment(experiment)
    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, step)
               for step, (loss, ms) in enumerate(zip(steps["loss"], steps["ms"]), start=1)
               for key, value in (("loss", loss), ("ppl", math.exp(min(loss, 700))), (f"ms_per_{unit}", ms))]
    metrics += [Metric(key, value, now, len(steps["loss"])) for key, value in summary.items()]
    with mlflow.start_run(run_name=engine) as run:
        mlflow.log_params({key: str(value) for key, value in params.items()})
        client = mlflow.MlflowClient()
        for start in range(0, len(metrics), MLFLOW_BATCH):
            client.log_batch(run.info.run_id, metrics=metrics[start:start + MLFLOW_BATCH])
    return run.info.run_id
