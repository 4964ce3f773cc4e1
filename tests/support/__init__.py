"""What the tests share beyond fixtures: a real gunicorn launcher (:mod:`tests.support.gunicorn`)
and loading a user tool of ``scripts/`` by its path (:mod:`tests.support.tools`)."""
