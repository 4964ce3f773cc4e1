"""The process layer: the gunicorn worker class and what sibling workers share. The only room
of ``app`` that knows gunicorn exists; the master imports it without importing torch."""
