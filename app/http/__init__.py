"""The HTTP edge: aiohttp routes, the error middleware, API keys, header and body limits,
keep-alive policy. The only rooms of ``app`` (with ``app.server``) that import aiohttp's web
server."""
