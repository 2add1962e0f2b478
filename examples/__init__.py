"""Runnable examples for ort-trainer (run from the repository root, e.g. ``python -m examples.wikitext2``)."""
