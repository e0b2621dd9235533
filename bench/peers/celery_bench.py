"""Celery doing sas's work: each step one HTTP POST to remote-sim with an
Idempotency-Key; 3 steps as a chain. Broker: the same RabbitMQ; `acks_late`.

Configuration comes from the environment (set by sas-bench):
BENCH_AMQP, BENCH_BACKEND (`rpc://` or `db+postgresql://…`), BENCH_QUEUE,
BENCH_SIM, BENCH_PATH (URL path prefix of the endpoints), BENCH_READY_FILE.

    python celery_bench.py drive --steps 1 --orders 10000 --timeout 120 --out r.json
    celery -A celery_bench worker …   (started by sas-bench)
"""

import argparse
import os
import sys
import time
import uuid

import requests
from celery import Celery, chain
from celery.result import ResultSet
from celery.signals import worker_ready

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIM, step_body, step_headers, write_result  # noqa: E402

QUEUE = os.environ.get("BENCH_QUEUE", "sasbench.celery")
BACKEND = os.environ.get("BENCH_BACKEND", "rpc://")
PATH = os.environ.get("BENCH_PATH", "celery")

app = Celery(
    "sasbench",
    broker=os.environ.get("BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//"),
    backend=BACKEND,
)
app.conf.update(
    task_acks_late=True,
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    task_send_sent_event=False,
    broker_connection_retry_on_startup=True,
    result_expires=None,
)

_session = None


def session():
    """One keep-alive HTTP session per worker process."""
    global _session
    if _session is None:
        _session = requests.Session()
    return _session


@app.task(name="sasbench.step")
def step(prev, order_id, name, t0):
    results = dict(prev["results"]) if isinstance(prev, dict) else {}
    r = session().post(
        f"{SIM}/{PATH}/{name}",
        json=step_body(order_id, name, results),
        headers=step_headers(order_id, name),
        timeout=5,
    )
    r.raise_for_status()
    results[name] = r.json()
    return {"results": results, "t0": t0, "done": time.time()}


@worker_ready.connect
def _ready(**_):
    path = os.environ.get("BENCH_READY_FILE")
    if path:
        with open(path, "w") as f:
            f.write("ready\n")


def submit(order_id, steps):
    t0 = time.time()
    if steps == 1:
        return t0, step.apply_async((None, order_id, "a", t0))
    sig = chain(
        step.s(None, order_id, "a", t0),
        *[step.s(order_id, s, t0) for s in ["b", "c"][: steps - 1]],
    )
    return t0, sig.apply_async()


def drive(args):
    cpu0 = time.process_time()
    ids = [str(uuid.uuid4()) for _ in range(args.orders)]
    first = time.time()
    sent = []
    for i, oid in enumerate(ids):
        if args.rate > 0:
            wait = first + i / args.rate - time.time()
            if wait > 0:
                time.sleep(wait)
        t0, r = submit(oid, args.steps)
        sent.append((oid, t0, r))
    submit_s = time.time() - first
    error = None
    latencies = []
    ends = []
    failed = 0
    deadline = first + args.timeout
    if BACKEND.startswith("rpc") and args.collect == "get":
        # The plain API: wait for each order's result in turn.
        for _, t0, r in sent:
            try:
                value = r.get(timeout=max(1.0, deadline - time.time()), propagate=False)
            except Exception as e:  # reported as it happens: e.g. BacklogLimitExceeded
                error = f"{type(e).__name__}: {e}"
                break
            if isinstance(value, dict) and "done" in value:
                latencies.append((value["done"] - t0) * 1000.0)
                ends.append(value["done"])
            else:
                failed += 1
    elif BACKEND.startswith("rpc"):
        # All results at once, as they arrive.
        got = {}

        def on_result(task_id, value):
            got[task_id] = (value, time.time())

        try:
            ResultSet([r for _, _, r in sent]).join_native(
                timeout=max(1.0, deadline - time.time()),
                propagate=False,
                callback=on_result,
            )
        except Exception as e:  # reported as it happens
            error = f"{type(e).__name__}: {e}"
        for _, t0, r in sent:
            if r.id not in got:
                continue
            value, _received = got[r.id]
            if isinstance(value, dict) and "done" in value:
                latencies.append((value["done"] - t0) * 1000.0)
                ends.append(value["done"])
            else:
                failed += 1
    else:
        import sqlalchemy as sa

        url = BACKEND.removeprefix("db+")
        engine = sa.create_engine(url)
        task_ids = [r.id for _, _, r in sent]
        q = sa.text(
            "SELECT task_id, status, extract(epoch from date_done) "
            "FROM celery_taskmeta WHERE task_id = ANY(:ids) "
            "AND status IN ('SUCCESS', 'FAILURE')"
        )
        # Every task of the run stores its result (a chain's earlier steps
        # too) in this run's own database: count them cheaply, then read the
        # final tasks' rows once.
        count = sa.text(
            "SELECT count(*) FROM celery_taskmeta WHERE status IN ('SUCCESS', 'FAILURE')"
        )
        with engine.connect() as conn:
            while time.time() < deadline:
                try:
                    (n,) = conn.execute(count).fetchone()
                except sa.exc.ProgrammingError:  # the worker has not created the table yet
                    n = 0
                conn.rollback()
                if n >= args.steps * len(task_ids):
                    break
                time.sleep(0.25)
            rows = conn.execute(q, {"ids": task_ids}).fetchall()
        t0_of = {r.id: t0 for _, t0, r in sent}
        for task_id, status, done in rows:
            if status == "SUCCESS":
                latencies.append((float(done) - t0_of[task_id]) * 1000.0)
                ends.append(float(done))
            else:
                failed += 1
        if len(rows) < len(task_ids) and error is None:
            error = f"timeout: {len(rows)} of {len(task_ids)} results after {args.timeout}s"
    completed = len(ends)
    elapsed = (max(ends) - first) if ends else None
    write_result(
        args.out,
        system="celery",
        backend=BACKEND.split(":")[0],
        steps=args.steps,
        orders=args.orders,
        completed=completed,
        failed=failed,
        error=error,
        submit_s=submit_s,
        elapsed_s=elapsed,
        latencies_ms=latencies,
        cpu_s=time.process_time() - cpu0,
    )


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive")
    d.add_argument("--steps", type=int, default=1)
    d.add_argument("--orders", type=int, default=1000)
    d.add_argument("--timeout", type=float, default=120)
    d.add_argument("--rate", type=float, default=0, help="orders/s; 0 is as fast as possible")
    d.add_argument(
        "--collect",
        choices=["get", "join"],
        default="get",
        help="rpc:// only: AsyncResult.get() per order, or ResultSet.join_native() for all",
    )
    d.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "drive":
        drive(args)


if __name__ == "__main__":
    main()
