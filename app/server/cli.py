"""``scoring-server``: the console command of the installed package (setup.py ``console_scripts``).

    scoring-server [GUNICORN OPTIONS] [APP_MODULE]

runs ``gunicorn -c python:app.server.gunicorn_config [GUNICORN OPTIONS] [APP_MODULE]`` in this
process, through gunicorn's own command-line runner: every gunicorn flag works as it does for
``gunicorn`` (``scoring-server --help`` is gunicorn's help; ``GUNICORN_CMD_ARGS`` too), the
packaged configuration (:mod:`app.server.gunicorn_config`, the same as a checkout's
``gunicorn.conf.py``) derives the rest from the ``SCORING_*`` variables, and the app is
``app.main:create_app`` unless ``APP_MODULE`` names another. The model repository is
``SCORING_MODEL_REPOSITORY``, by default ``model_repository`` in the working directory. A
``-c``/``--config`` of the caller's comes later on the command line and so replaces the packaged
configuration (gunicorn keeps the last one).

``python -m app.server.cli`` does the same.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: The packaged gunicorn configuration, as gunicorn's ``-c`` names a module.
CONFIG = "python:app.server.gunicorn_config"
PROG = "scoring-server"


def gunicorn_args(args: Sequence[str]) -> list[str]:
    """gunicorn's command line (without the program name) for ``scoring-server args``."""
    return ["-c", CONFIG, *args]


def main(argv: Sequence[str] | None = None) -> None:
    """Run gunicorn with the packaged configuration; ``argv``: the arguments (default
    ``sys.argv[1:]``). Exits the way gunicorn exits (its status)."""
    args = sys.argv[1:] if argv is None else argv
    # gunicorn parses sys.argv itself, again at each HUP reload, and a USR2 re-exec runs
    # ``python sys.argv[0] sys.argv[1:]``: the script stays argv[0] (a re-exec prepends the
    # -c again, harmless: gunicorn keeps the last).
    sys.argv = [sys.argv[0], *gunicorn_args(args)]
    from gunicorn.app.wsgiapp import run

    run(prog=PROG)


if __name__ == "__main__":
    main()
