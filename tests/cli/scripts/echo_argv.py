"""Print this rank's script arguments (and a stderr line) as JSON."""

from __future__ import annotations

import json
import sys

print("ARGV " + json.dumps(sys.argv[1:]))
print("to-stderr", file=sys.stderr)
