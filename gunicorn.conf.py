"""Gunicorn configuration of the scoring server, for a checkout:

    gunicorn -c gunicorn.conf.py                      # serves app.main:create_app
    gunicorn -c gunicorn.conf.py -w 4 -b 127.0.0.1:9000 app.main:create_app

The configuration itself is ``app/server/gunicorn_config.py`` (settings and hooks, from the
``SCORING_*`` variables); an installed package runs the same with ``scoring-server`` or
``gunicorn -c python:app.server.gunicorn_config``. Gunicorn executes this file again at each HUP
reload: the module is dropped from ``sys.modules`` first, so that it runs again too.
"""

import sys

sys.modules.pop("app.server.gunicorn_config", None)

from app.server.gunicorn_config import *  # noqa: E402, F403
