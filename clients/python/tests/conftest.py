"""Fixtures: the deployment under test comes from the environment, which
the Rust end-to-end test ``tests/tests/suite/python.rs`` sets after
starting a real deployment (submission, scheduler, agent, supervisor):

- ``SAS_BROKER_URL``: its RabbitMQ;
- ``SAS_PREFIX``: its ``broker.prefix``;
- ``SAS_WORKFLOW``: a workflow that ends ``processed`` (default ``one``);
- ``SAS_FAILING_WORKFLOW``: a workflow one of whose steps fails for good
  (default ``three``).

Without ``SAS_PREFIX`` the tests that need a deployment are skipped (the
pure ones still run); ``SAS_REQUIRE_DEPLOYMENT=1`` makes that an error.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Iterator, List

import pika
import pytest

from sas_saga_client import Client


@dataclass
class Deployment:
    url: str
    prefix: str
    workflow: str
    failing_workflow: str


@pytest.fixture(scope="session")
def deployment() -> Deployment:
    prefix = os.environ.get("SAS_PREFIX")
    if not prefix:
        if os.environ.get("SAS_REQUIRE_DEPLOYMENT") == "1":
            pytest.fail("SAS_PREFIX is not set: run through tests/tests/suite/python.rs")
        pytest.skip("no deployment: SAS_PREFIX is not set (tests/tests/suite/python.rs sets it)")
    return Deployment(
        url=os.environ.get("SAS_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        prefix=prefix,
        workflow=os.environ.get("SAS_WORKFLOW", "one"),
        failing_workflow=os.environ.get("SAS_FAILING_WORKFLOW", "three"),
    )


@pytest.fixture
def raw(deployment: Deployment) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    """A plain pika channel on the deployment's broker, for what an
    application does not send through the client (fake events)."""
    conn = pika.BlockingConnection(pika.URLParameters(deployment.url))
    try:
        yield conn.channel()
    finally:
        conn.close()


@pytest.fixture
def queues(deployment: Deployment) -> Iterator[List[str]]:
    """Makes status queue names of this test (not under ``<prefix>.``, which
    is sas's), deleted at the end."""
    made: List[str] = []
    yield made
    conn = pika.BlockingConnection(pika.URLParameters(deployment.url))
    try:
        for q in made:
            ch = conn.channel()
            try:
                ch.queue_delete(q)
                ch.close()
            except pika.exceptions.AMQPError:
                pass
    finally:
        conn.close()


@pytest.fixture
def new_queue(deployment: Deployment, queues: List[str]):
    def make(name: str = "status") -> str:
        q = f"{deployment.prefix}-py.{name}.{uuid.uuid4().hex[:8]}"
        queues.append(q)
        return q

    return make


@pytest.fixture
def client(deployment: Deployment, new_queue) -> Iterator[Client]:
    """A client with a status queue of its own."""
    with Client(deployment.url, deployment.prefix, status_queue=new_queue()) as c:
        yield c
