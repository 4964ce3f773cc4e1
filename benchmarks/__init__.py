"""Measurement harnesses: each starts the server (or drives one) and writes what it measured.

Run one from the repository root as ``python -m benchmarks.<name>`` (``--help`` for its
options); docs/benchmarks.md says what each measures, where its figures came from, and the
command that made them. The harnesses share :mod:`benchmarks.driver` (the load),
:mod:`benchmarks.payloads` (the requests), :mod:`benchmarks.report` (the records and tables)
and :mod:`benchmarks.server` (starting the server; the launcher is the tests',
:mod:`tests.support.gunicorn`).
"""
