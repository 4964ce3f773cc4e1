"""Observability: Prometheus multiprocess metrics and structured logging."""
