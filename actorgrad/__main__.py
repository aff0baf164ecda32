"""Allow ``python -m actorgrad ...`` (same as the ``actorgrad`` command)."""

from __future__ import annotations

import sys

from actorgrad.cli import main

if __name__ == "__main__":
    sys.exit(main())
