"""What the tests share; no test module imports another test module, only these:

- :mod:`tests.support.fixtures`: the shared fixtures (tests/conftest.py makes them available)
  and the helpers of in-process tests (``eventually``, ``wait_ready``);
- :mod:`tests.support.gunicorn`: the real gunicorn launcher (benchmarks/ uses it too);
- :mod:`tests.support.toy_models`, :mod:`tests.support.fake_gpus`,
  :mod:`tests.support.demo_repo`: model repositories and fake NVML files to test on;
- :mod:`tests.support.tools`: loading a user tool of ``scripts/`` by its path;
- what tests of several files send or read: :mod:`~tests.support.messages`,
  :mod:`~tests.support.fuzz`, :mod:`~tests.support.metrics`, :mod:`~tests.support.balance`,
  :mod:`~tests.support.tls`, :mod:`~tests.support.openapi`, :mod:`~tests.support.deploy`;
- :mod:`tests.support.grpc_clients` (run as a module) and :mod:`tests.support.h2_peer`: the
  stock gRPC clients and hostile HTTP/2 peers the end-to-end tests use.
"""
