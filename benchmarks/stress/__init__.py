"""The stress run: every API of a real server under c = 64 closed-loop users (locust) for as long
as asked, while a scenario schedule (``schedule*.toml``, data) kills clients mid-request,
cancels, times out, reads slowly, reloads, unloads and loads models (a broken version among
them), SIGKILLs a worker, HUPs the master, removes the response cache's store and stops Redis.
Every answer is checked against a reference; the workers' RSS, descriptors and threads are
sampled throughout. ``python -m benchmarks.stress --duration 30m`` (docs/reliability.md,
*Stress run*).

Modules: ``repository`` (the models served), ``target`` (the server, Redis, model control),
``apis`` (the requests of each API and how an answer is read), ``oracle`` (references,
outcomes and the bounds), ``wire`` (the clients), ``traffic`` (one request sent and judged),
``schedule`` (the schedule file and its actions), ``monitor`` (psutil samples),
``locustfile`` (the user classes and the load shape), ``run`` (the whole run).

This package's ``__init__`` imports nothing: ``__main__`` must import locust (which
monkey-patches the standard library for gevent) before anything else.
"""
