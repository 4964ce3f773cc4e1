"""Observability: Prometheus metric definitions, the NVML GPU poller, structured logging.
Imports nothing of app.http or app.serving (they import this)."""
