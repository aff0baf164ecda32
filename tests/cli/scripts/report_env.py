"""Print the launcher-provided environment of this rank as one JSON line."""

from __future__ import annotations

import hashlib
import json
import os

key = os.environ.get("ACTORGRAD_AUTH_KEY")
print(
    "ENV "
    + json.dumps(
        {
            "rank": os.environ.get("RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            "store_port": os.environ.get("ACTORGRAD_MASTER_PORT"),
            "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "auth_key_set": key is not None,
            "auth_key_len": len(key) if key else 0,
            "auth_key_sha256": hashlib.sha256(key.encode()).hexdigest() if key else None,
        },
        sort_keys=True,
    )
)
