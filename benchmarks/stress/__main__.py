"""``python -m benchmarks.stress``: see :mod:`benchmarks.stress.run`.

locust is imported first: it monkey-patches the standard library for gevent, which must happen
before anything else imports ``socket``, ``ssl`` or ``threading``; and gRPC is told to run on
gevent's loop before any channel exists.
"""

import locust  # noqa: F401, I001 - first: gevent's monkey-patching
import grpc.experimental.gevent

grpc.experimental.gevent.init_gevent()

import sys  # noqa: E402

from benchmarks.stress.run import main  # noqa: E402

sys.exit(main())
