"""DBOS Transact (Postgres only) doing sas's work: one workflow per order
(workflow id = order id) on a DBOS queue, each step a `@DBOS.step()` that is
one HTTP POST to remote-sim with an Idempotency-Key, steps one after another.

Configuration from the environment (set by sas-bench): BENCH_DSN (the DBOS
system database, created and dropped by sas-bench), BENCH_SIM, BENCH_PATH,
BENCH_READY_FILE, BENCH_POLL (the queue's polling interval, seconds).

    python dbos_bench.py schema          # migrate the system database, register the queue
    python dbos_bench.py worker --index 0 --concurrency 16
    python dbos_bench.py drive --steps 1 --orders 10000 --timeout 120 --out r.json

The driver enqueues with `DBOSClient` (no DBOS runtime of its own, so it never
runs workflows) and learns completion from `dbos.workflow_status`, which DBOS
writes in the transaction that ends each workflow (`completed_at`, epoch ms).
"""

import argparse
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import requests
from dbos import DBOS, DBOSClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIM, step_body, step_headers, write_result  # noqa: E402

DSN = os.environ.get("BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
PATH = os.environ.get("BENCH_PATH", "dbos")
POLL = float(os.environ.get("BENCH_POLL", "0.01"))
APP = "sasbench"
QUEUE = "sasbench_orders"
WORKFLOW = "sasbench.order"
STEPS = ["a", "b", "c"]

_local = threading.local()


def session():
    """One keep-alive HTTP session per thread (DBOS runs workflows on threads)."""
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = requests.Session()
    return s


@DBOS.step(name="sasbench.call")
def call(order_id, name, results):
    r = session().post(
        f"{SIM}/{PATH}/{name}",
        json=step_body(order_id, name, results),
        headers=step_headers(order_id, name),
        timeout=5,
    )
    r.raise_for_status()
    return r.json()


@DBOS.workflow(name=WORKFLOW)
def order(order_id, steps):
    results = {}
    for name in STEPS[:steps]:
        results[name] = call(order_id, name, results)
    return results


def config(executor_id, migrate):
    return {
        "name": APP,
        "system_database_url": DSN,
        "executor_id": executor_id,
        "log_level": "WARNING",
        "run_migrations": migrate,
    }


def register_queue(concurrency):
    return DBOS.register_queue(
        QUEUE,
        worker_concurrency=concurrency,
        polling_interval_sec=POLL,
        on_conflict="always_update",
    )


def schema(args):
    DBOS(config=config("schema", True))
    DBOS.launch()
    register_queue(args.concurrency)
    DBOS.destroy()


def worker(args):
    DBOS(config=config(f"worker-{args.index}", False))
    DBOS.launch()
    register_queue(args.concurrency)
    path = os.environ.get("BENCH_READY_FILE")
    if path:
        with open(path, "w") as f:
            f.write("ready\n")
    threading.Event().wait()  # until sas-bench stops the process group


def drive(args):
    cpu0 = time.process_time()
    client = DBOSClient(system_database_url=DSN, application_name=APP)
    ids = [str(uuid.uuid4()) for _ in range(args.orders)]
    t0 = {}
    first = time.time()

    def enqueue(i, oid):
        if args.rate > 0:
            wait = first + i / args.rate - time.time()
            if wait > 0:
                time.sleep(wait)
        t0[oid] = time.time()
        client.enqueue(
            {"queue_name": QUEUE, "workflow_name": WORKFLOW, "workflow_id": oid},
            oid,
            args.steps,
        )

    if args.rate > 0:
        for i, oid in enumerate(ids):
            enqueue(i, oid)
    else:
        # As fast as possible: several enqueues in flight, like procrastinate's driver.
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: enqueue(*p), enumerate(ids)))
    submit_s = time.time() - first
    deadline = first + args.timeout
    error = None
    with psycopg.connect(DSN, autocommit=True) as conn:
        while True:
            (done,) = conn.execute(
                "SELECT count(*) FROM dbos.workflow_status "
                "WHERE queue_name = %s AND status IN ('SUCCESS', 'ERROR', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED')",
                (QUEUE,),
            ).fetchone()
            if done >= args.orders or time.time() > deadline:
                break
            time.sleep(0.25)
        rows = conn.execute(
            "SELECT workflow_uuid, status, completed_at FROM dbos.workflow_status "
            "WHERE queue_name = %s AND status IN ('SUCCESS', 'ERROR', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED')",
            (QUEUE,),
        ).fetchall()
    client.destroy()
    latencies, ends, failed = [], [], 0
    for oid, status, completed_at in rows:
        if status == "SUCCESS" and completed_at is not None and oid in t0:
            at = completed_at / 1000.0
            latencies.append((at - t0[oid]) * 1000.0)
            ends.append(at)
        else:
            failed += 1
    if len(rows) < args.orders:
        error = f"timeout: {len(rows)} of {args.orders} done after {args.timeout}s"
    write_result(
        args.out,
        system="dbos",
        backend="postgres",
        steps=args.steps,
        orders=args.orders,
        completed=len(ends),
        failed=failed,
        error=error,
        submit_s=submit_s,
        elapsed_s=(max(ends) - first) if ends else None,
        latencies_ms=latencies,
        cpu_s=time.process_time() - cpu0,
    )


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("schema")
    s.add_argument("--concurrency", type=int, default=16)
    w = sub.add_parser("worker")
    w.add_argument("--index", type=int, default=0)
    w.add_argument("--concurrency", type=int, default=16, help="workflows at once per process")
    d = sub.add_parser("drive")
    d.add_argument("--steps", type=int, default=1)
    d.add_argument("--orders", type=int, default=1000)
    d.add_argument("--timeout", type=float, default=120)
    d.add_argument("--rate", type=float, default=0, help="orders/s; 0 is as fast as possible")
    d.add_argument("--out", required=True)
    args = p.parse_args()
    {"schema": schema, "worker": worker, "drive": drive}[args.cmd](args)


if __name__ == "__main__":
    main()
