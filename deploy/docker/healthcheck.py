"""Container health check: exit 0 when the server's /health answers 200, 1 otherwise.

Python rather than curl so the runtime images need no extra package; the port comes from
SAMROLLOUT_PORT, as the server's does.
"""

import os
import sys
import urllib.request

port = os.environ.get("SAMROLLOUT_PORT", "8000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError:
    sys.exit(1)
