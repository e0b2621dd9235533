#!/usr/bin/env bash
# The demo application: submits a batch of `order` workflow orders that name a
# private status queue, then prints the status events that come back on it.
#
# Used by docker-compose.yml (service `demo`) and scripts/run-local.sh; runs
# anywhere sasctl can reach the broker (sasctl reads the same configuration as
# the services: SAS_CONFIG / --config, then SAS__SECTION__KEY variables).
#
# Environment:
#   SASCTL              sasctl binary to run (default: sasctl on PATH)
#   DEMO_ORDERS         how many orders to submit (default 20)
#   DEMO_QUEUE          the application's private status queue (default demo.status)
#   DEMO_WATCH_TIMEOUT  how long `sasctl watch` waits for the next event
#                       before it gives up (default 30s); it stops as soon as
#                       every order it submitted has ended
#   DEMO_WORKFLOW       workflow to submit (default order)
#   DEMO_PAYLOAD        the orders' payload (JSON object)
set -euo pipefail

SASCTL=${SASCTL:-sasctl}
DEMO_ORDERS=${DEMO_ORDERS:-20}
DEMO_QUEUE=${DEMO_QUEUE:-demo.status}
DEMO_WATCH_TIMEOUT=${DEMO_WATCH_TIMEOUT:-30s}
DEMO_WORKFLOW=${DEMO_WORKFLOW:-order}
DEMO_PAYLOAD=${DEMO_PAYLOAD:-'{"sku":"book-42","qty":1,"amount_cents":1999}'}

echo "demo: submitting ${DEMO_ORDERS} '${DEMO_WORKFLOW}' orders, status events to ${DEMO_QUEUE}" >&2
summary=$("$SASCTL" submit \
    --workflow "$DEMO_WORKFLOW" \
    --count "$DEMO_ORDERS" \
    --reply-to "$DEMO_QUEUE" \
    --payload "$DEMO_PAYLOAD" \
    --json)
# The ids it submitted (UUIDs in the JSON summary's order_ids), so that the
# watch ends with the last of them instead of after a silence.
watch_ids=()
while read -r id; do
    watch_ids+=(--order-id "$id")
done < <(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' <<<"$summary")
if [ ${#watch_ids[@]} -eq 0 ]; then
    echo "demo: sasctl submit named no order id: $summary" >&2
    exit 1
fi

echo "demo: watching ${DEMO_QUEUE} until the $((${#watch_ids[@]} / 2)) orders end (timeout ${DEMO_WATCH_TIMEOUT} without an event)" >&2
exec "$SASCTL" watch "$DEMO_QUEUE" "${watch_ids[@]}" --until-terminal --timeout "$DEMO_WATCH_TIMEOUT"
