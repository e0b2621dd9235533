"""What the peer benchmarks share: the step's HTTP call and the result file."""

import json
import os
import time

SIM = os.environ.get("BENCH_SIM", "http://127.0.0.1:8081")


def step_body(order_id, name, results):
    """The body the sas agent sends to a remote service."""
    return {
        "order_id": order_id,
        "step": name,
        "attempt": 1,
        "payload": {},
        "results": results,
    }


def step_headers(order_id, name):
    """The idempotency key the sas agent sends: `<order_id>:<step>`."""
    return {"Idempotency-Key": f"{order_id}:{name}"}


def write_result(path, **fields):
    """Writes the run's outcome as JSON for sas-bench to read."""
    fields.setdefault("written_at", time.time())
    with open(path, "w") as f:
        json.dump(fields, f)
