"""Where the API listens unless told otherwise: cheap to import (no aiohttp), so the
command line can show these in its help without loading the server."""

DEFAULT_HOST = "127.0.0.1"
# Below the ports Linux (32768-60999) and macOS (49152-65535) hand out to outgoing
# connections, where a client socket could hold it when the server starts; below the
# agents' control ports (28500 up) too.
DEFAULT_PORT = 28415
API_KEY_ENV = "STUDIOTUI_API_KEY"
