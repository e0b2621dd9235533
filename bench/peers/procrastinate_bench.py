"""procrastinate (Postgres-only) doing sas's work: each step one HTTP POST to
remote-sim with an Idempotency-Key; 3 steps by each job deferring the next.

Configuration from the environment (set by sas-bench): BENCH_DSN, BENCH_SIM,
BENCH_PATH, BENCH_READY_FILE.

    python procrastinate_bench.py schema
    python procrastinate_bench.py worker --concurrency 16
    python procrastinate_bench.py drive --steps 1 --orders 10000 --timeout 120 --out r.json
"""

import argparse
import asyncio
import os
import sys
import time
import uuid

import httpx
import psycopg
from procrastinate import App, PsycopgConnector

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIM, step_body, step_headers, write_result  # noqa: E402

DSN = os.environ.get("BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
PATH = os.environ.get("BENCH_PATH", "procrastinate")
STEPS = ["a", "b", "c"]

app = App(connector=PsycopgConnector(conninfo=DSN, min_size=1, max_size=16))
_client = None


def client():
    global _client
    if _client is None:
        _client = httpx.AsyncClient(timeout=5.0)
    return _client


@app.task(name="sasbench.step")
async def step(order_id, name, steps, t0, results, last):
    r = await client().post(
        f"{SIM}/{PATH}/{name}",
        json=step_body(order_id, name, results),
        headers=step_headers(order_id, name),
    )
    r.raise_for_status()
    results = dict(results)
    results[name] = r.json()
    i = STEPS.index(name)
    if i + 1 < steps:
        nxt = STEPS[i + 1]
        await step.defer_async(
            order_id=order_id,
            name=nxt,
            steps=steps,
            t0=t0,
            results=results,
            last=(i + 2 == steps),
        )


async def schema():
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def worker(concurrency):
    async with app.open_async():
        path = os.environ.get("BENCH_READY_FILE")
        if path:
            with open(path, "w") as f:
                f.write("ready\n")
        await app.run_worker_async(concurrency=concurrency, install_signal_handlers=True)


async def drive(args):
    cpu0 = time.process_time()
    in_flight = asyncio.Semaphore(16)
    first = time.time()

    async def defer(i, oid):
        if args.rate > 0:
            wait = first + i / args.rate - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
        async with in_flight:
            await step.defer_async(
                order_id=oid,
                name="a",
                steps=args.steps,
                t0=time.time(),
                results={},
                last=(args.steps == 1),
            )

    async with app.open_async():
        await asyncio.gather(*(defer(i, str(uuid.uuid4())) for i in range(args.orders)))
    submit_s = time.time() - first
    deadline = first + args.timeout
    error = None
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FROM procrastinate_jobs "
                "WHERE (args->>'last')::boolean AND status IN ('succeeded', 'failed')"
            )
            (done,) = await cur.fetchone()
            if done >= args.orders or time.time() > deadline:
                break
            await asyncio.sleep(0.25)
        cur = await conn.execute(
            "SELECT j.status, (j.args->>'t0')::float8, extract(epoch from e.at)::float8 "
            "FROM procrastinate_jobs j LEFT JOIN procrastinate_events e "
            "ON e.job_id = j.id AND e.type = 'succeeded' "
            "WHERE (j.args->>'last')::boolean AND j.status IN ('succeeded', 'failed')"
        )
        rows = await cur.fetchall()
    latencies, ends, failed = [], [], 0
    for status, t0, at in rows:
        if status == "succeeded" and at is not None:
            latencies.append((at - t0) * 1000.0)
            ends.append(at)
        else:
            failed += 1
    if len(rows) < args.orders:
        error = f"timeout: {len(rows)} of {args.orders} done after {args.timeout}s"
    write_result(
        args.out,
        system="procrastinate",
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
    sub.add_parser("schema")
    w = sub.add_parser("worker")
    w.add_argument("--concurrency", type=int, default=16)
    d = sub.add_parser("drive")
    d.add_argument("--steps", type=int, default=1)
    d.add_argument("--orders", type=int, default=1000)
    d.add_argument("--timeout", type=float, default=120)
    d.add_argument("--rate", type=float, default=0, help="orders/s; 0 is as fast as possible")
    d.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "schema":
        asyncio.run(schema())
    elif args.cmd == "worker":
        asyncio.run(worker(args.concurrency))
    else:
        asyncio.run(drive(args))


if __name__ == "__main__":
    main()
