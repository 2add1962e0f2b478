"""The command-line vocabulary both examples share: engine names (one canonical name each, older
spellings as aliases), every flag also spelled with underscores, the ``--help`` description, the
progress bar of training and evaluation, and an engine's import of ort_trainer (refused with how to install it)."""
from __future__ import annotations

import argparse
import importlib
import sys

from tqdm import tqdm

#: Other spellings of an engine name: ``pytorch`` was the Wikitext-2 example's name for ``torch``.
ENGINE_ALIASES = {"pytorch": "torch"}


def canonical_engine(name: str) -> str:
    return ENGINE_ALIASES.get(name, name)


def description(doc: str) -> str:
    """The first paragraph of a module docstring, as one line (``--help`` shows it whole)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def add_option(parser: argparse.ArgumentParser, name: str, **kwargs):
    """``--some-flag``, also spelled ``--some_flag`` as in Hugging Face's scripts."""
    return parser.add_argument(f"--{name}", *([f"--{name.replace('-', '_')}"] if "-" in name else []), **kwargs)


def add_engine_option(parser: argparse.ArgumentParser, engines, default: str, help: str):
    aliases = ", ".join(f"{alias}: {name}" for alias, name in ENGINE_ALIASES.items() if name in engines)
    return add_option(parser, "engine", type=canonical_engine, choices=sorted(engines), default=default,
                      help=f"{help} (default: {default}; also accepted: {aliases})")


def engine_imports(engine: str, module: str, *names: str):
    """``names`` from ``module`` (ort_trainer or one of its submodules), imported only when ``--engine
    engine`` runs, or a SystemExit saying that engine needs a working ort_trainer and how to install it."""
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"error: --engine {engine} needs a working ort_trainer "
                         f"(pip install -e '.[cpu]' from the repository root): {exc}") from exc
    return tuple(getattr(imported, name) for name in names)


def progress(iterable=None, *, args, **kwargs):
    """A tqdm bar on stderr, off with --quiet or when stderr is not a terminal."""
    kwargs.setdefault("leave", False)
    return tqdm(iterable, disable=args.quiet or not sys.stderr.isatty(), **kwargs)
