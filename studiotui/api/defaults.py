"""Where the API listens unless told otherwise: cheap to import (no aiohttp), so the
command line can show these in its help without loading the server."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 52415
API_KEY_ENV = "STUDIOTUI_API_KEY"
