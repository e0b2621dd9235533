//! What one order costs the state store, counted by Postgres itself: the
//! transactions a batch of orders takes, and the rows each transition writes;
//! and what consumed messages cost the broker in acknowledgements; what
//! one order waits for the disk (Postgres's syncs of its log, counted on a
//! server of the test's own) and which of its messages RabbitMQ keeps on
//! disk. These pin the levers that make sas fast (batches share a transaction; a
//! transition writes each order row once; deliveries finished together share
//! an ack frame), whatever the timings.

use std::collections::BTreeMap;

use sas::config::Settings;
use sas::engine::{Actor, ClaimBounds, Outlet, ReplyOutcome, Submitted, Transitions};
use sas::messages::{Events, StepOutcome, StepReply, StepRequest};
use sas::state::ProcessState;
use sas::state_store::{
    Committed, DeletedBy, Held, NewOrder, OutboxRow, Plans, StateStore, StoreError,
};
use sas::workflow::Workflow;
use sas_tests::TestApp;
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// Orders per batch.
const N: usize = 40;

/// Each statement run outside an explicit transaction is prepared on its
/// first use on a connection, and Postgres counts that round trip as a
/// transaction of its own: the load of a claim, the load of a reply, and
/// the write-back. A service's long-lived connections have them prepared
/// already.
const FIRST_USES: i64 = 3;

/// Transactions of `passes` relay passes: each takes its orders' messages
/// with their outbox locks (a statement that commits without waiting for
/// the disk), publishes them, then deletes them and lets the locks go (the
/// same); no transaction spans the publish. Both statements are prepared on
/// their first use.
fn relay_passes(passes: i64) -> i64 {
    2 * passes + 2
}

/// Transactions of a transition other than a submit: its load and its
/// write-back, each a statement atomic on its own. Only the write-back
/// waits for the disk (the loads change no data, or commit without waiting).
const PER_TRANSITION: i64 = 2;

/// Postgres's counters for the test database: committed transactions, and
/// rows inserted, updated and deleted per table. A backend reports its counts
/// when it exits, so the readers poll until the numbers hold still.
#[derive(Debug, Default, Clone, PartialEq)]
struct Counters {
    commits: i64,
    rows: BTreeMap<(String, &'static str), i64>,
}

/// Committed transactions of the test database ([`sas_tests::pg_commits`]).
async fn commits(url: &str) -> i64 {
    sas_tests::pg_commits(url.rsplit('/').next().unwrap_or_default()).await
}

/// Rows written per table (reading writes none); `hot-updated` are the
/// updates that wrote no index entry (heap-only tuples); `scanned whole`
/// counts the table's sequential scans. Per index, the `entries read`.
async fn rows(url: &str) -> BTreeMap<(String, &'static str), i64> {
    let options = url
        .parse::<PgConnectOptions>()
        .expect("url")
        .application_name(RUN);
    let mut conn = PgConnection::connect_with(&options).await.expect("connect");
    let tables: Vec<(String, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd, seq_scan \
         FROM pg_stat_user_tables",
    )
    .fetch_all(&mut conn)
    .await
    .expect("pg_stat_user_tables");
    let indexes: Vec<(String, i64)> =
        sqlx::query_as("SELECT indexrelname::text, idx_tup_read FROM pg_stat_user_indexes")
            .fetch_all(&mut conn)
            .await
            .expect("pg_stat_user_indexes");
    // The system catalogs' too: a worker's transactions count in the run's.
    let autovacuumed: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0)::bigint \
         FROM pg_stat_all_tables",
    )
    .fetch_one(&mut conn)
    .await
    .expect("pg_stat_all_tables");
    conn.close().await.ok();
    let mut rows = BTreeMap::new();
    rows.insert((AUTOVACUUM.to_owned(), "runs"), autovacuumed);
    for (index, read) in indexes {
        rows.insert((index, "entries read"), read);
    }
    for (table, ins, upd, del, hot, scans) in tables {
        rows.insert((table.clone(), "scanned whole"), scans);
        rows.insert((table.clone(), "inserted"), ins);
        rows.insert((table.clone(), "updated"), upd);
        rows.insert((table.clone(), "hot-updated"), hot);
        rows.insert((table, "deleted"), del);
    }
    rows
}

/// The pseudo-table under which [`rows`] counts autovacuum and autoanalyze
/// runs on any of the database's tables, the system catalogs included.
const AUTOVACUUM: &str = "(autovacuum)";

/// Polls `read` until two reads in a row agree (other backends' statistics
/// reach `pg_stat_*` up to a few hundred milliseconds late); panics if they
/// have not settled within 30 s.
async fn settled<T: PartialEq, F: AsyncFn() -> T>(read: F) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut last = read().await;
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "statistics did not settle within 30s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let now = read().await;
        if now == last {
            return now;
        }
        last = now;
    }
}

impl Counters {
    /// Before a run: the rows first, then the transactions, once the rows
    /// reader's own transaction has been counted.
    async fn before(url: &str) -> Self {
        let rows = settled(async || rows(url).await).await;
        gone(url).await;
        let commits = settled(async || commits(url).await).await;
        Self { commits, rows }
    }

    /// After a run whose connections are closed: the transactions first, so
    /// that the rows reader's own transaction is not among them. A backend
    /// reports its counts as it exits, which comes after the client closed
    /// it: the counts are read once every connection of [`pool`] is gone.
    async fn after(url: &str) -> Self {
        gone(url).await;
        let commits = settled(async || commits(url).await).await;
        let rows = settled(async || rows(url).await).await;
        Self { commits, rows }
    }

    fn since(&self, before: &Self, table: &str, what: &'static str) -> i64 {
        let key = (table.to_owned(), what);
        self.rows.get(&key).copied().unwrap_or(0) - before.rows.get(&key).copied().unwrap_or(0)
    }
}

/// Waits (at most 60 s) until no autovacuum worker is connected to the
/// database of `url`.
async fn no_autovacuum_worker(url: &str) {
    until_none(
        url,
        "backend_type = 'autovacuum worker'",
        "autovacuum workers",
    )
    .await;
}

/// The `application_name` of the connections [`pool`] and [`rows`] open.
const RUN: &str = "sas-costs-run";

/// Waits (at most 60 s) until no connection of [`pool`] or [`rows`] to the
/// database of `url` is left.
async fn gone(url: &str) {
    until_none(
        url,
        "application_name = 'sas-costs-run'",
        "connections of the run",
    )
    .await;
}

/// Waits (at most 60 s) until no backend connected to the database of
/// `url` has `kind` as its `backend_type` or its `application_name`.
async fn until_none(url: &str, kind: &str, what: &str) {
    let database = url.rsplit('/').next().unwrap_or_default();
    let mut admin = PgConnection::connect(sas_tests::pg_admin())
        .await
        .expect("connect");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = $1 AND $2 IN (backend_type, application_name)",
        )
        .bind(database)
        .bind(kind)
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_activity");
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{left} {what} still there after 60s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    admin.close().await.ok();
}

/// Makes every open connection of `pool` report its counts now. An idle
/// backend that reported less than a second ago keeps its counts for up to
/// ten seconds: reported during a run, they would count as the run's
/// (CI saw the test app's set-up land in a connection's cost).
async fn report_now(pool: &sqlx::PgPool) {
    let mut conns = Vec::new();
    for _ in 0..pool.size() {
        conns.push(pool.acquire().await.expect("acquire"));
    }
    for conn in &mut conns {
        // The backend reports as it goes idle, before it answers.
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&mut **conn)
            .await
            .expect("pg_stat_force_next_flush");
    }
}

/// A pool of one connection, planning as the services' do
/// ([`Plans::Generic`]: a statement that no index serves scans its table
/// whole, which [`Cost::scans`] counts, however few rows it holds).
async fn pool(url: &str) -> sqlx::PgPool {
    let options = url
        .parse::<PgConnectOptions>()
        .expect("url")
        .options(Plans::Generic.settings().iter().copied())
        .application_name(RUN);
    PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .expect("pool")
}

/// Turns autovacuum off for the database's tables: an autovacuum or
/// autoanalyze worker's transactions count in `xact_commit` too (CI saw 19
/// of them land in one run's count).
async fn quiet_autovacuum(app: &TestApp) {
    sqlx::query(
        "DO $$ DECLARE t text; BEGIN \
           FOR t IN SELECT quote_ident(tablename) FROM pg_tables WHERE schemaname = 'public' LOOP \
             EXECUTE 'ALTER TABLE ' || t || ' SET (autovacuum_enabled = off)'; \
           END LOOP; END $$",
    )
    .execute(&app.db)
    .await
    .expect("autovacuum off");
}

/// One connection of [`pool`], opened and closed: what opening it costs on
/// its own (the driver's set-up), to leave out of a run's count.
async fn connect_cost(url: &str) -> i64 {
    let before = Counters::before(url).await;
    pool(url).await.close().await;
    Counters::after(url).await.commits - before.commits
}

/// Takes the messages transitions hand over, as a service's relay would,
/// and deletes them at once.
#[derive(Debug, Default)]
struct Recorder {
    /// Says it is too busy to take hand-overs.
    busy: bool,
    /// Keeps what it is handed, unreleased, in `kept`.
    keep: bool,
    kept: std::sync::Mutex<Vec<(Held, Vec<i64>)>>,
    rows: std::sync::Mutex<Vec<OutboxRow>>,
    later: std::sync::Mutex<Vec<Uuid>>,
    follow: std::sync::Mutex<Vec<Uuid>>,
    releases: tokio_util::task::TaskTracker,
    /// Publishes as this instance: the requests it is handed stay handed.
    instance: Option<String>,
    /// Status events handed over, "confirmed", for a write-back to delete.
    published: std::sync::Mutex<Vec<i64>>,
}

// The engine's port: transitions hand over to it as to a service's relay.
impl Outlet for Recorder {
    fn ready(&self) -> bool {
        !self.busy
    }

    /// Takes what a transition committed, as a relay's `hand_over` does.
    fn hand_over(&self, committed: Committed) {
        self.later.lock().unwrap().extend(committed.later);
        self.follow.lock().unwrap().extend(committed.follow);
        self.publish(committed.held, committed.publish);
    }

    fn publisher(&self) -> Option<String> {
        self.instance.clone()
    }

    fn take_published(&self) -> Vec<i64> {
        std::mem::take(&mut *self.published.lock().unwrap())
    }

    fn keep_published(&self, ids: Vec<i64>) {
        self.published.lock().unwrap().extend(ids);
    }
}

impl Recorder {
    /// Records the rows; deletes them, but for the handed ones, and lets
    /// the locks go, as a relay does once they are published; keeps the
    /// handed status events for a write-back to delete.
    fn publish(&self, held: Option<Held>, rows: Vec<OutboxRow>) {
        let by = |whom: DeletedBy| -> Vec<i64> {
            rows.iter()
                .filter(|r| r.deleted_by() == whom)
                .map(|r| r.id)
                .collect()
        };
        let ids = by(DeletedBy::Release);
        self.keep_published(by(DeletedBy::WriteBack));
        self.rows.lock().unwrap().extend(rows);
        let Some(held) = held else { return };
        if self.keep {
            return self.kept.lock().unwrap().push((held, ids));
        }
        self.releases
            .spawn(async move { held.release(&ids).await.expect("release") });
    }
}

impl Recorder {
    /// The messages handed over since the last call, once deleted.
    async fn take(&self) -> Vec<OutboxRow> {
        self.releases.close();
        self.releases.wait().await;
        self.releases.reopen();
        std::mem::take(&mut *self.rows.lock().unwrap())
    }
}

/// Transitions whose committed messages go to a recorder (the engine's
/// outlet), as a service's go to its relay; or nowhere (left to a relay's
/// sweep).
#[derive(Clone)]
struct Handed {
    t: Transitions,
}

impl Handed {
    fn plain(t: Transitions) -> Self {
        Self { t }
    }

    fn to(t: Transitions, recorder: std::sync::Arc<Recorder>) -> Self {
        Self {
            t: t.handing_to(recorder),
        }
    }

    async fn submit(&self, o: &NewOrder, wf: &Workflow) -> Result<Submitted, StoreError> {
        self.t.submit(o, wf).await
    }

    async fn submit_many(
        &self,
        b: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        self.t.submit_many(b).await
    }

    async fn submit_and_start(
        &self,
        me: &Actor,
        b: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        self.t.submit_and_start(me, 1000, u32::MAX, b).await
    }

    async fn claim(&self, me: &Actor, limit: u32, max: u32) -> Result<Vec<Uuid>, StoreError> {
        let bounds = ClaimBounds::orders(limit, max);
        Ok(self.t.claim(me, bounds).await?.ids)
    }

    async fn apply_reply(&self, me: &Actor, r: &StepReply) -> Result<ReplyOutcome, StoreError> {
        self.t.apply_reply(me, r).await
    }

    async fn apply_replies(
        &self,
        me: &Actor,
        r: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        self.t.apply_replies(me, r).await
    }
}

/// A one-step order whose events go to `reply_to`.
fn one_step_order(reply_to: String) -> NewOrder {
    NewOrder {
        order_id: Uuid::new_v4(),
        workflow: "one".into(),
        payload: json!({}),
        reply_to: Some(reply_to),
        priority: 0,
        not_before: None,
        trace_id: None,
        trace_span: None,
        events: sas::messages::Events::All,
        application: None,
        app_order_id: None,
    }
}

/// A one-step order submitted with a hand-over that has not let go yet, as
/// while `received` is being published: the returned [`Held`] (on a pool of
/// its own, the returned store's) holds the order's outbox lock, to be
/// released with the id of `received`.
async fn submitted_still_publishing(
    app: &TestApp,
    queue: &str,
) -> (NewOrder, StateStore, Held, Vec<i64>) {
    let order = one_step_order(app.status_queue(queue).await);
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let (held, received) = submitted_holding(app, &store, &[&order]).await;
    assert_eq!(received.len(), 1, "received");
    (order, store, held, received)
}

/// One-step `orders` submitted together on `store` with a hand-over that
/// has not let go yet: the [`Held`] connection and the ids of the messages
/// handed over.
async fn submitted_holding(
    app: &TestApp,
    store: &StateStore,
    orders: &[&NewOrder],
) -> (Held, Vec<i64>) {
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let publishing = std::sync::Arc::new(Recorder {
        keep: true,
        ..Recorder::default()
    });
    let batch: Vec<(&NewOrder, &Workflow)> = orders.iter().map(|&o| (o, &wf)).collect();
    Handed::to(
        Transitions::new(store.clone(), app.queues.clone()),
        publishing.clone(),
    )
    .submit_many(&batch)
    .await
    .expect("submit");
    let kept = publishing.kept.lock().unwrap().pop();
    kept.expect("handed over")
}

/// How a run's messages leave the outbox.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Publishing {
    /// A relay's pass after each transition (the operators' tools).
    Relay,
    /// Handed over by each transition as it commits (the services).
    Handoff,
}

/// What a run cost: transactions, rows per table, and the messages relayed by kind.
struct Cost {
    commits: i64,
    after: Counters,
    before: Counters,
    relayed: BTreeMap<String, usize>,
}

impl Cost {
    fn rows(&self, table: &str, what: &'static str) -> i64 {
        self.after.since(&self.before, table, what)
    }

    /// The sequential scans of the tables that grow with the orders: each
    /// would read every order ever kept, on every transition. The services'
    /// statements find their rows by index instead, whatever the table holds.
    fn scans(&self) -> BTreeMap<&'static str, i64> {
        ["orders", "steps", "outbox", "order_events"]
            .into_iter()
            .map(|t| (t, self.rows(t, "scanned whole")))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// Runs `N` orders of `workflow` to `processed` through the library's
/// transitions, as the services would with full batches, on one connection.
async fn run_batch(app: &TestApp, workflow: &str, publishing: Publishing, events: Events) -> Cost {
    run_batch_keeping(app, workflow, publishing, events, 0).await
}

/// [`run_batch`], with `kept` ended orders (one step each) stored once the
/// batch is submitted: the run's connection made its plans while the
/// tables held the batch alone, as a new deployment's connections do.
///
/// Autovacuum cannot be turned off for the system catalogs, which the
/// migrations filled: a run during which a worker vacuumed or analysed one
/// (its transactions count in the database's) is run again with new orders.
async fn run_batch_keeping(
    app: &TestApp,
    workflow: &str,
    publishing: Publishing,
    events: Events,
    kept: i64,
) -> Cost {
    for _ in 0..4 {
        // A worker's transactions reach the counts when it exits, which
        // may be well after its last vacuum is counted: none may be at
        // work when the measure starts, nor start one until it ends (the
        // set-up's own measure included, which CI saw take 8 of them).
        no_autovacuum_worker(&app.db_url).await;
        let start = settled(async || rows(&app.db_url).await).await;
        let cost = run_batch_once(app, workflow, publishing, events, kept).await;
        if cost.after.since(
            &Counters {
                commits: 0,
                rows: start,
            },
            AUTOVACUUM,
            "runs",
        ) == 0
        {
            return cost;
        }
    }
    panic!("autovacuum ran during each of four runs");
}

async fn run_batch_once(
    app: &TestApp,
    workflow: &str,
    publishing: Publishing,
    events: Events,
    kept: i64,
) -> Cost {
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow(workflow).expect("workflow");
    let status = app.status_queue("costs").await;
    quiet_autovacuum(app).await;
    report_now(&app.db).await;
    let setup = connect_cost(&app.db_url).await;
    let before = Counters::before(&app.db_url).await;
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let recorder = std::sync::Arc::new(Recorder::default());
    let t = Transitions::new(store.clone(), app.queues.clone());
    let t = match publishing {
        Publishing::Relay => Handed::plain(t),
        Publishing::Handoff => Handed::to(t, recorder.clone()),
    };
    let mut orders = sas_testkit::fixtures::new_orders(workflow, N, &status);
    for o in &mut orders {
        o.events = events;
    }
    let ids: Vec<Uuid> = orders.iter().map(|o| o.order_id).collect();
    let mut relayed = BTreeMap::new();
    let relay_rows = async || {
        if publishing == Publishing::Handoff {
            return recorder.take().await;
        }
        let (busy, rows) = relay_pass(&store, &ids, false).await;
        assert!(busy.is_empty(), "no other relay runs");
        rows
    };

    let batch: Vec<(&NewOrder, &sas::workflow::Workflow)> =
        orders.iter().map(|o| (o, &wf)).collect();
    let submitted = t.submit_many(&batch).await.expect("submit");
    assert!(
        submitted
            .iter()
            .all(|s| matches!(s, Submitted::Created { .. }))
    );
    if kept > 0 {
        sqlx::query(
            // Compensated: not among the batch's processed orders counted below.
            "WITH o AS (INSERT INTO orders (order_id, workflow, payload, process_state) \
               SELECT gen_random_uuid(), 'one', '{}', 'compensated' FROM generate_series(1, $1) \
               RETURNING order_id) \
             INSERT INTO steps (order_id, idx, name, agent, timeout_ms, state) \
               SELECT order_id, 0, 'a', 'agent-a', 1000, 'compensated' FROM o",
        )
        .bind(kept)
        .execute(&app.db)
        .await
        .expect("kept orders");
        report_now(&app.db).await;
    }
    let note = |rows: &[sas::state_store::OutboxRow], relayed: &mut BTreeMap<String, usize>| {
        for r in rows {
            *relayed.entry(r.kind.clone()).or_default() += 1;
        }
    };
    let rows = relay_rows().await;
    note(&rows, &mut relayed);

    let me = Actor::new_instance("scheduler");
    let claimed = t.claim(&me, N as u32, N as u32).await.expect("claim");
    assert_eq!(claimed.len(), N);
    let mut rows = relay_rows().await;
    note(&rows, &mut relayed);
    // Each round answers every request out: a step at a time, or the
    // parallel steps that run at once.
    loop {
        let replies: Vec<StepReply> = rows
            .iter()
            .filter(|r| r.kind == "request")
            .map(|r| {
                let req: StepRequest = serde_json::from_slice(&r.body).expect("request");
                StepReply::to(
                    &req,
                    StepOutcome::Succeeded {
                        result: json!({ "ok": true }),
                    },
                )
            })
            .collect();
        if replies.is_empty() {
            break;
        }
        let outcomes = t.apply_replies(&me, &replies).await.expect("replies");
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, ReplyOutcome::Applied { .. }))
        );
        rows = relay_rows().await;
        note(&rows, &mut relayed);
    }
    assert!(
        recorder.later.lock().unwrap().is_empty(),
        "nothing was left to the relay"
    );
    store.close().await;
    let after = Counters::after(&app.db_url).await;
    let processed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders WHERE process_state = $1 AND order_id = ANY($2)",
    )
    .bind(ProcessState::Processed.as_str())
    .bind(&ids)
    .fetch_one(&app.db)
    .await
    .expect("count");
    assert_eq!(processed, N as i64);
    let cost = Cost {
        commits: after.commits - before.commits - setup,
        after,
        before,
        relayed,
    };
    assert_eq!(cost.scans(), BTreeMap::new(), "tables scanned whole");
    cost
}

#[tokio::test]
async fn a_batch_of_one_step_orders_costs_the_same_statements_as_one_and_writes_each_order_row_once_per_transition()
 {
    let app = TestApp::new().await;
    let c = run_batch(&app, "one", Publishing::Relay, Events::All).await;
    let n = N as i64;
    // Submit, claim and reply, each followed by one relay's pass:
    // whatever the batch size.
    assert_eq!(
        c.commits,
        1 + 2 * PER_TRANSITION + relay_passes(3) + FIRST_USES,
        "transactions for {N} orders"
    );
    assert_eq!(c.rows("orders", "inserted"), n);
    // Claimed, then finished: one new row version each.
    assert_eq!(c.rows("orders", "updated"), 2 * n);
    assert_eq!(c.rows("steps", "inserted"), n);
    // Dispatched, then finished.
    assert_eq!(c.rows("steps", "updated"), 2 * n);
    // received, processing, step_succeeded, processed.
    assert_eq!(c.rows("order_events", "inserted"), 4 * n);
    // The four status events and the step request; each published once, then deleted.
    assert_eq!(c.rows("outbox", "inserted"), 5 * n);
    assert_eq!(c.rows("outbox", "deleted"), 5 * n);
    assert_eq!(c.relayed.get("status"), Some(&(4 * N)));
    assert_eq!(c.relayed.get("request"), Some(&N));
}

#[tokio::test]
async fn a_batch_of_three_step_orders_costs_the_same_statements_as_one_and_writes_each_order_row_once_per_transition()
 {
    let app = TestApp::new().await;
    let c = run_batch(&app, "three", Publishing::Relay, Events::All).await;
    let n = N as i64;
    // Submit, claim and three replies, each followed by one relay.
    assert_eq!(
        c.commits,
        1 + 4 * PER_TRANSITION + relay_passes(5) + FIRST_USES,
        "transactions for {N} orders"
    );
    assert_eq!(c.rows("orders", "inserted"), n);
    assert_eq!(c.rows("orders", "updated"), 4 * n);
    // The replies to steps a and b leave the order running: its new
    // version can go beside the old one, without index entries (with an
    // index on what they change, none could). How many do depends on when
    // the old versions on a page can be pruned: all but a few on an idle
    // server, half when it is busy.
    let hot = c.rows("orders", "hot-updated");
    assert!(hot > 0, "{hot} of {} HOT", 2 * n);
    assert_eq!(c.rows("steps", "inserted"), 3 * n);
    assert_eq!(c.rows("steps", "updated"), 6 * n);
    // received, processing, three step_succeeded, processed.
    assert_eq!(c.rows("order_events", "inserted"), 6 * n);
    assert_eq!(c.rows("outbox", "inserted"), 9 * n);
    assert_eq!(c.rows("outbox", "deleted"), 9 * n);
    assert_eq!(c.relayed.get("status"), Some(&(6 * N)));
    assert_eq!(c.relayed.get("request"), Some(&(3 * N)));
}

#[tokio::test]
async fn with_terminal_events_a_batch_queues_only_its_requests_and_one_status_event_per_order() {
    for (workflow, steps, logged) in [("one", 1, 4), ("three", 3, 6)] {
        let app = TestApp::new().await;
        let c = run_batch(&app, workflow, Publishing::Relay, Events::Terminal).await;
        let n = N as i64;
        // The same rows and statements as with every event…
        assert_eq!(
            c.commits,
            1 + (steps + 1) * PER_TRANSITION + relay_passes(steps + 2) + FIRST_USES,
            "{workflow}: transactions for {N} orders"
        );
        assert_eq!(c.rows("orders", "updated"), (steps + 1) * n, "{workflow}");
        // …the whole history logged, for a replay…
        assert_eq!(c.rows("order_events", "inserted"), logged * n, "{workflow}");
        // …but only the step requests and `processed` go through the outbox.
        assert_eq!(c.rows("outbox", "inserted"), (steps + 1) * n, "{workflow}");
        assert_eq!(c.rows("outbox", "deleted"), (steps + 1) * n, "{workflow}");
        assert_eq!(c.relayed.get("status"), Some(&N), "{workflow}");
        assert_eq!(
            c.relayed.get("request"),
            Some(&(steps as usize * N)),
            "{workflow}"
        );
    }
}

#[tokio::test]
async fn a_batch_of_diamond_orders_runs_its_parallel_steps_in_one_transition_each_round() {
    let app = TestApp::new().await;
    let c = run_batch(&app, "diamond", Publishing::Relay, Events::All).await;
    let n = N as i64;
    // Submit, claim, and three rounds of replies (a; b and c; d) — b and c
    // answered together are one transition — each followed by one relay.
    assert_eq!(
        c.commits,
        1 + 4 * PER_TRANSITION + relay_passes(5) + FIRST_USES,
        "transactions for {N} orders"
    );
    assert_eq!(c.rows("orders", "inserted"), n);
    assert_eq!(c.rows("orders", "updated"), 4 * n);
    assert_eq!(c.rows("steps", "inserted"), 4 * n);
    assert_eq!(c.rows("steps", "updated"), 8 * n);
    // received, processing, four step_succeeded, processed.
    assert_eq!(c.rows("order_events", "inserted"), 7 * n);
    assert_eq!(c.rows("outbox", "inserted"), 11 * n);
    assert_eq!(c.rows("outbox", "deleted"), 11 * n);
    assert_eq!(c.relayed.get("status"), Some(&(7 * N)));
    assert_eq!(c.relayed.get("request"), Some(&(4 * N)));
}

#[tokio::test]
async fn a_claim_stops_at_its_bound_of_requests_and_the_next_claims_the_rest() {
    // A burst of fan-out orders: a claim of `claim_batch` of them would hold
    // `claim_batch` times their fan-out in messages at once.
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.fan]
steps = [{ name = "reserve", agent = "a", for_each = "payload.items" }]
"#,
        )
        .build()
        .await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("fan").expect("workflow");
    let status = app.status_queue("bound").await;
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let t = Transitions::new(store.clone(), app.queues.clone());
    // Five requests per order, and with every event a status event too:
    // only the requests count (had the events, each order would weigh six
    // and the claims would stop at two).
    let mut orders = sas_testkit::fixtures::new_orders("fan", 8, &status);
    for o in &mut orders {
        o.payload = json!({ "items": [1, 2, 3, 4, 5] });
        o.events = Events::All;
    }
    let batch: Vec<(&NewOrder, &Workflow)> = orders.iter().map(|o| (o, &wf)).collect();
    t.submit_many(&batch).await.expect("submit");
    let count = async |sql: &'static str| -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&app.db)
            .await
            .expect("count")
    };
    let me = Actor::new_instance("scheduler");
    let bounds = ClaimBounds {
        requests: 12,
        ..ClaimBounds::orders(8, 8)
    };
    let mut seen = std::collections::BTreeSet::new();
    // Each claim decides orders until their requests reach twelve: three
    // (fifteen requests), three more, then the last two with room to spare.
    for (claimed, more) in [(3, true), (3, true), (2, false)] {
        let done = t.claim(&me, bounds).await.expect("claim");
        assert_eq!((done.ids.len(), done.more), (claimed, more));
        assert!(done.ids.iter().all(|id| seen.insert(*id)));
        let requests = count("SELECT count(*) FROM outbox WHERE kind = 'request'").await;
        assert_eq!(requests, 5 * seen.len() as i64);
        // The orders read but not decided are as they were: pending, free.
        let free = count(
            "SELECT count(*) FROM orders WHERE process_state = 'pending' AND locked_by IS NULL",
        )
        .await;
        assert_eq!(free, (orders.len() - seen.len()) as i64);
    }
    // A bound below one order's messages still claims one at a time.
    let mut more = sas_testkit::fixtures::new_orders("fan", 2, &status);
    for o in &mut more {
        o.payload = json!({ "items": [1, 2, 3, 4, 5] });
    }
    let batch: Vec<(&NewOrder, &Workflow)> = more.iter().map(|o| (o, &wf)).collect();
    t.submit_many(&batch).await.expect("submit");
    let tight = ClaimBounds {
        requests: 1,
        ..bounds
    };
    let me = Actor::new_instance("scheduler");
    let first = t.claim(&me, tight).await.expect("claim");
    assert_eq!((first.ids.len(), first.more), (1, true));
    let second = t.claim(&me, tight).await.expect("claim");
    assert_eq!(second.ids.len(), 1);
    assert_ne!(first.ids, second.ids);
    store.close().await;
}

#[tokio::test]
async fn a_write_back_reads_the_orders_and_steps_it_writes_not_every_one_kept() {
    // Ended orders stay until pruned, and a connection keeps the plans it
    // made at its first statements. Had a write-back joined its batch to
    // a whole table (a hash join over the primary key, chosen while the
    // table was small), it would read every order kept, on every transition.
    let app = TestApp::new().await;
    const KEPT: i64 = 5_000;
    let c = run_batch_keeping(&app, "three", Publishing::Relay, Events::All, KEPT).await;
    // Three steps: four loads and four write-backs, each reading a handful
    // of entries per order (more where an update could not stay on its
    // page, leaving a second entry for its key until a vacuum): fewer in
    // the whole run than one scan of the kept orders would read.
    for index in ["orders_pkey", "steps_pkey"] {
        let read = c.rows(index, "entries read");
        assert!(read < KEPT, "{index}: {read} entries read for {N} orders");
    }
}

#[tokio::test]
async fn a_steps_update_of_its_running_order_needs_no_index_entry_and_finds_room_on_its_page() {
    // A step's write-back moves `complete_by` to the next step's deadline
    // and counts its status events: were either indexed, every step would
    // write a new entry into each of the orders' indexes.
    let app = TestApp::new().await;
    let indexed: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE tablename = 'orders' \
         AND indexdef ~ '\\m(complete_by|last_seq|updated_at)\\M'",
    )
    .fetch_all(&app.db)
    .await
    .expect("pg_indexes");
    assert_eq!(indexed, Vec::<String>::new());
    // And room on each page for a batch's new versions of its rows: an
    // old version is pruned only once its replacement has committed.
    let options: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT relname::text, reloptions::text[] FROM pg_class \
         WHERE relname IN ('orders', 'steps') ORDER BY relname",
    )
    .fetch_all(&app.db)
    .await
    .expect("pg_class");
    for (table, options) in options {
        assert!(
            options.iter().any(|o| o == "fillfactor=50"),
            "{table}: {options:?}"
        );
    }
}

#[tokio::test]
async fn the_tables_a_transition_writes_fire_no_triggers() {
    // A foreign key is a trigger per inserted row that looks up and locks
    // the referenced row: the write-back inserts its steps and events only
    // with their order, and prune deletes them with it.
    let app = TestApp::new().await;
    let triggers: Vec<(String, String)> = sqlx::query_as(
        "SELECT tgrelid::regclass::text, tgname::text FROM pg_trigger \
         WHERE tgrelid = ANY(ARRAY['orders', 'steps', 'order_events', 'outbox']::regclass[])",
    )
    .fetch_all(&app.db)
    .await
    .expect("pg_trigger");
    assert_eq!(triggers, []);
}

#[tokio::test]
async fn handed_over_messages_cost_one_statement_per_transition_and_need_no_relay() {
    // Each transition that publishes is followed by the one statement that
    // deletes its messages and lets the outbox locks go (also outside a
    // transaction, so its first use counts too). With terminal events the
    // submit publishes nothing, takes no lock and needs no such statement.
    for (events, releases, messages, statuses) in
        [(Events::All, 3, 5, 4), (Events::Terminal, 2, 2, 1)]
    {
        let app = TestApp::new().await;
        let c = run_batch(&app, "one", Publishing::Handoff, events).await;
        let n = N as i64;
        assert_eq!(
            c.commits,
            1 + 2 * PER_TRANSITION + releases + FIRST_USES + 1,
            "transactions for {N} orders, {events:?}"
        );
        assert_eq!(c.rows("orders", "updated"), 2 * n);
        assert_eq!(c.rows("outbox", "inserted"), messages * n);
        assert_eq!(c.rows("outbox", "deleted"), messages * n);
        assert_eq!(c.relayed.get("status"), Some(&(statuses * N)));
        assert_eq!(c.relayed.get("request"), Some(&N));
        let locks: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&app.db)
        .await
        .expect("pg_locks");
        assert_eq!(locks, 0, "every outbox lock was let go");
    }
}

#[tokio::test]
async fn a_submit_locks_only_the_new_orders_it_has_messages_for() {
    // In a batch mixing every-event and terminal-event orders, the second
    // publish nothing when stored: had the submit locked them too, a claim
    // arriving before its release would find the lock taken and leave its
    // messages to a follower's relay pass, with nothing to wait for.
    let app = TestApp::new().await;
    let status = app.status_queue("mixed").await;
    let every = one_step_order(status.clone());
    let terminal = NewOrder {
        events: Events::Terminal,
        application: None,
        app_order_id: None,
        ..one_step_order(status)
    };
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let (held, received) = submitted_holding(&app, &store, &[&every, &terminal]).await;
    assert_eq!(received.len(), 1, "`received` of the every-event order");
    let locked: Vec<Uuid> = sqlx::query_scalar(
        "SELECT o.order_id FROM orders o JOIN pg_locks l ON l.locktype = 'advisory' \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND (l.classid::bigint << 32 | l.objid::bigint) \
             = hashtextextended('sas.outbox:' || o.order_id::text, 0)",
    )
    .fetch_all(&app.db)
    .await
    .expect("pg_locks");
    assert_eq!(locked, vec![every.order_id]);
    held.release(&received).await.expect("release");
    store.close().await;
}

#[tokio::test]
async fn an_order_with_older_messages_waiting_is_left_to_the_relay_so_its_events_stay_in_order() {
    let app = TestApp::new().await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let status = app.status_queue("older").await;
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let order = one_step_order(status);
    // Submitted by a process that leaves its `received` event in the outbox.
    let plain = Handed::plain(Transitions::new(store.clone(), app.queues.clone()));
    plain.submit(&order, &wf).await.expect("submit");
    let recorder = std::sync::Arc::new(Recorder::default());
    let direct = Handed::to(plain.t.clone(), recorder.clone());
    let me = Actor::new_instance("scheduler");
    let claimed = direct.claim(&me, 10, 10).await.expect("claim");
    assert_eq!(claimed, vec![order.order_id]);
    assert!(
        recorder.take().await.is_empty(),
        "nothing published ahead of `received`"
    );
    assert_eq!(*recorder.later.lock().unwrap(), vec![order.order_id]);
    let kinds: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT kind, convert_from(body, 'UTF8')::jsonb->>'state' FROM outbox \
         WHERE order_id = $1 ORDER BY id",
    )
    .bind(order.order_id)
    .fetch_all(&app.db)
    .await
    .expect("outbox");
    let kinds: Vec<String> = kinds
        .into_iter()
        .map(|(k, s)| s.map_or(k.clone(), |s| format!("{k}:{s}")))
        .collect();
    assert_eq!(
        kinds,
        ["status:received", "status:processing", "request"],
        "every message waits for the relay, oldest first"
    );
    store.close().await;
}

#[tokio::test]
async fn a_relay_too_busy_for_hand_overs_gets_every_message_through_its_pass() {
    let app = TestApp::new().await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let busy = std::sync::Arc::new(Recorder {
        busy: true,
        ..Recorder::default()
    });
    let t = Handed::to(
        Transitions::new(store.clone(), app.queues.clone()),
        busy.clone(),
    );
    let order = one_step_order(app.status_queue("busy").await);
    t.submit(&order, &wf).await.expect("submit");
    let me = Actor::new_instance("scheduler");
    assert_eq!(t.claim(&me, 10, 10).await.expect("claim").len(), 1);
    assert!(busy.take().await.is_empty(), "nothing handed over");
    assert_eq!(
        *busy.later.lock().unwrap(),
        vec![order.order_id, order.order_id],
        "each transition told the relay"
    );
    let (busy, relayed) = relay_pass(&store, &[order.order_id], false).await;
    assert!(busy.is_empty(), "no outbox lock was taken");
    assert_eq!(relayed.len(), 3, "received, processing and the request");
    store.close().await;
}

#[tokio::test]
async fn a_transition_does_not_wait_for_the_previous_publisher_and_its_messages_follow_in_order() {
    let app = TestApp::new().await;
    let (order, submitter, held, received) = submitted_still_publishing(&app, "follow").await;
    let store = StateStore::from_pool(pool(&app.db_url).await);
    let recorder = std::sync::Arc::new(Recorder::default());
    let direct = Handed::to(
        Transitions::new(store.clone(), app.queues.clone()),
        recorder.clone(),
    );
    let me = Actor::new_instance("scheduler");
    let claimed =
        tokio::time::timeout(std::time::Duration::from_secs(5), direct.claim(&me, 10, 10))
            .await
            .expect("the claim does not wait for the publisher")
            .expect("claim");
    assert_eq!(claimed, vec![order.order_id]);
    assert!(
        recorder.take().await.is_empty(),
        "nothing published ahead of `received`"
    );
    assert!(recorder.later.lock().unwrap().is_empty());
    assert_eq!(*recorder.follow.lock().unwrap(), vec![order.order_id]);
    // A follower waits for the lock, then publishes the rest in order.
    let follower = {
        let store = store.clone();
        let id = order.order_id;
        tokio::spawn(async move { relay_pass(&store, &[id], true).await })
    };
    app.wait_for_lock_waiters(1).await;
    assert!(
        !follower.is_finished(),
        "the follower waits for the publisher"
    );
    held.release(&received).await.expect("release");
    let (busy, relayed) = follower.await.expect("join");
    assert!(busy.is_empty());
    let published: Vec<String> = relayed
        .iter()
        .map(|r| {
            let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
            body["state"]
                .as_str()
                .map_or(r.kind.clone(), |s| format!("{}:{s}", r.kind))
        })
        .collect();
    assert_eq!(
        published,
        ["status:processing", "request"],
        "the rest of the order's messages, oldest first, and not `received` again"
    );
    submitter.close().await;
    store.close().await;
}

#[tokio::test]
async fn a_relay_pass_takes_its_orders_without_locking_or_writing_their_rows() {
    let app = TestApp::new().await;
    let (order, store, held, _) = submitted_still_publishing(&app, "take").await;
    // Nothing published: the hand-over lets go and leaves `received` queued.
    held.release(&[]).await.expect("release");
    let taken = store
        .take_outbox(&[order.order_id], false)
        .await
        .expect("take");
    assert_eq!(taken.rows.len(), 1, "received");
    // A row lock would mark the rows (`xmax`): a write, and a WAL record,
    // per message on every pass. The order's advisory lock is enough.
    let marked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE order_id = $1 AND xmax::text <> '0'")
            .bind(order.order_id)
            .fetch_one(&app.db)
            .await
            .expect("xmax");
    assert_eq!(marked, 0, "the take locked no outbox row");
    let published: Vec<i64> = taken.rows.iter().map(|r| r.id).collect();
    taken.held.release(&published).await.expect("release");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE order_id = $1")
        .bind(order.order_id)
        .fetch_one(&app.db)
        .await
        .expect("count");
    assert_eq!(left, 0, "published and deleted");
    store.close().await;
}

#[tokio::test]
async fn a_hand_over_lets_its_outbox_locks_go_only_once_its_messages_are_deleted() {
    let app = TestApp::new().await;
    let (order, store, held, received) = submitted_still_publishing(&app, "release").await;
    // Someone holds the published row, so the hand-over's delete must wait.
    let mut blocker = PgConnection::connect(&app.db_url).await.expect("connect");
    let mut tx = blocker.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM outbox WHERE id = ANY($1) FOR UPDATE")
        .bind(&received)
        .execute(&mut *tx)
        .await
        .expect("row lock");
    let release = tokio::spawn(async move { held.release(&received).await });
    app.wait_for_lock_waiters(1).await;
    let mut other = PgConnection::connect(&app.db_url).await.expect("connect");
    let free: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtextextended('sas.outbox:' || $1::text, 0))",
    )
    .bind(order.order_id)
    .fetch_one(&mut other)
    .await
    .expect("try lock");
    assert!(
        !free,
        "the order's lock is still held while its published rows are not deleted: \
         a relay taking it now would publish them again"
    );
    tx.rollback().await.expect("rollback");
    release.await.expect("join").expect("release");
    store.close().await;
}

#[tokio::test]
async fn the_services_connections_plan_each_statement_once_and_the_operators_per_execution() {
    let app = TestApp::new().await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let mode = |store: StateStore| async move {
        let show = |setting: &'static str| sqlx::query_scalar::<_, String>(setting);
        let mode = (
            show("SHOW plan_cache_mode")
                .fetch_one(store.pool())
                .await
                .expect("show"),
            show("SHOW enable_seqscan")
                .fetch_one(store.pool())
                .await
                .expect("show"),
        );
        store.close().await;
        mode
    };
    let services = StateStore::connect_with(&settings.database, "costs", Plans::Generic)
        .await
        .expect("connect");
    assert_eq!(
        mode(services).await,
        ("force_generic_plan".into(), "off".into()),
        "the services plan once, and never scan a table whole where an index serves"
    );
    let operators = StateStore::connect(&settings.database, "costs")
        .await
        .expect("connect");
    assert_eq!(mode(operators).await, ("auto".into(), "on".into()));
}

/// Counts the statements sqlx sends (its `sqlx::query` events), one per
/// round trip: a simple query of several statements is one. With
/// `COSTS_DEBUG` set, prints each one's summary (to see what a count holds).
#[derive(Clone, Default)]
struct RoundTrips(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl RoundTrips {
    fn take(&self) -> usize {
        self.0.swap(0, std::sync::atomic::Ordering::SeqCst)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for RoundTrips {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if std::env::var_os("COSTS_DEBUG").is_some() {
                struct V;
                impl tracing::field::Visit for V {
                    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                        if f.name() == "summary" {
                            eprintln!("STMT {v:?}");
                        }
                    }
                }
                event.record(&mut V);
            }
        }
    }
}

/// For counting round trips: the workflow `one`, a status queue `queue`, a
/// store on one connection (round two of a test counts it with its
/// statements prepared), and transitions over it that hand nothing over.
async fn one_connection(app: &TestApp, queue: &str) -> (Workflow, String, StateStore, Handed) {
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let status = app.status_queue(queue).await;
    let mut database = settings.database.clone();
    database.max_connections = 1;
    let store = StateStore::connect_with(&database, "costs", Plans::Generic)
        .await
        .expect("connect");
    let t = Handed::plain(Transitions::new(store.clone(), app.queues.clone()));
    (wf, status, store, t)
}

#[tokio::test]
async fn claims_and_replies_cost_two_round_trips_and_relay_passes_three() {
    // (Counted: the statements sqlx logs.)
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let (wf, status, store, t) = one_connection(&app, "trips").await;
    let trips = RoundTrips::default();
    // The test's runtime has one thread: every task of it reports here.
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let me = Actor::new_instance("scheduler");
    for round in 0..2 {
        let order = one_step_order(status.clone());
        t.submit(&order, &wf).await.expect("submit");
        trips.take();
        let claimed = t.claim(&me, 10, 10).await.expect("claim");
        assert_eq!(claimed, vec![order.order_id]);
        let claim = trips.take();
        // A relay's pass takes the messages, then deletes them once they are out.
        let (busy, published) = relay_pass(&store, &[order.order_id], false).await;
        let relay = trips.take();
        assert!(busy.is_empty());
        assert_eq!(published.len(), 3, "received, processing and the request");
        let request = published
            .into_iter()
            .find(|r| r.kind == "request")
            .expect("a request");
        let request: StepRequest = serde_json::from_slice(&request.body).expect("request");
        let reply = StepReply::to(
            &request,
            StepOutcome::Succeeded {
                result: json!({ "ok": true }),
            },
        );
        trips.take();
        let applied = t.apply_reply(&me, &reply).await.expect("reply");
        assert!(
            matches!(applied, ReplyOutcome::Applied { .. }),
            "{applied:?}"
        );
        let apply = trips.take();
        if round == 1 {
            assert_eq!(
                (claim, apply),
                (2, 2),
                "the load, then the write-back (each atomic on its own): two round trips each"
            );
            // Each bounded on its own (`database.io_timeout`), since the
            // publish between them waits for the broker.
            assert_eq!(
                relay, 2,
                "the take, then the delete once the messages are out: no transaction spans the publish"
            );
        }
    }
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
           AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&app.db)
    .await
    .expect("activity");
    assert_eq!(open, 0, "no connection left a transaction open");
    store.close().await;
}

#[tokio::test]
async fn a_new_order_started_by_its_submission_costs_one_round_trip_in_the_room_the_last_start_read_and_no_claim()
 {
    // (Counted: the statements sqlx logs.) Stored and started in one
    // write-back after one read of the room: a scheduler neither wakes nor
    // reads the order back (the load and write-back of a claim).
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let (wf, status, store, plain) = one_connection(&app, "started").await;
    // With no outlet that publishes at once (a busy relay's, or none), the
    // order waits for a scheduler's claim.
    let me = Actor::new_instance("submission");
    let waits = one_step_order(status.clone());
    let submitted = plain
        .submit_and_start(&me, &[(&waits, &wf)])
        .await
        .expect("submit");
    assert_eq!(submitted, [Submitted::Created { started: false }]);
    let scheduler = Actor::new_instance("scheduler");
    let claimed = plain.claim(&scheduler, 10, 10).await.expect("claim");
    assert_eq!(claimed, vec![waits.order_id]);
    // Handed over as to a service's relay, which publishes at once: only
    // then does a submission start orders.
    let recorder = std::sync::Arc::new(Recorder::default());
    // The room each start's write-back reads stands for the next start
    // (kept here for as long as the test runs).
    let t = Handed::to(
        Transitions::new(store.clone(), app.queues.clone())
            .keeping_room_for(std::time::Duration::from_secs(3600)),
        recorder.clone(),
    );
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let mut starts = Vec::new();
    for round in 0..3 {
        let order = one_step_order(status.clone());
        trips.take();
        let submitted = t
            .submit_and_start(&me, &[(&order, &wf)])
            .await
            .expect("submit");
        let start = trips.take();
        assert_eq!(submitted, [Submitted::Created { started: true }]);
        let published = recorder.take().await;
        let claimed = t.claim(&scheduler, 10, 10).await.expect("claim");
        assert_eq!(claimed, Vec::<Uuid>::new(), "nothing left to claim");
        let kinds: Vec<&str> = published.iter().map(|r| r.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["status", "status", "request"],
            "received, processing, the request"
        );
        let request: StepRequest = serde_json::from_slice(&published[2].body).expect("request");
        assert_eq!(request.locked_by, me.name);
        let reply = StepReply::to(
            &request,
            StepOutcome::Succeeded {
                result: json!({ "ok": true }),
            },
        );
        trips.take();
        let applied = t.apply_reply(&scheduler, &reply).await.expect("reply");
        assert!(
            matches!(applied, ReplyOutcome::Applied { .. }),
            "{applied:?}"
        );
        let apply = trips.take();
        recorder.take().await;
        starts.push(start);
        if round > 0 {
            assert_eq!(apply, 2, "the reply's load, then its write-back");
        }
    }
    assert_eq!(
        starts,
        [2, 1, 1],
        "the room, then the write-back; then only the write-back, in the room the last one read"
    );
    store.close().await;
}

/// The step request of `published` (one of them).
fn request_of(published: &[OutboxRow]) -> StepRequest {
    let row = published
        .iter()
        .find(|r| r.kind == "request")
        .expect("a request");
    serde_json::from_slice(&row.body).expect("request")
}

/// Three-step orders started by a submission over one connection, their
/// messages handed to a recorder (as to a relay that publishes at once),
/// and schedulers over the same store that keep the orders they reply to.
struct Started {
    store: StateStore,
    status: String,
    wf: Workflow,
    recorder: std::sync::Arc<Recorder>,
    submission: Handed,
}

impl Started {
    async fn new(app: &TestApp, queue: &str) -> Self {
        let (_, status, store, _) = one_connection(app, queue).await;
        let settings = Settings::load(Some(&app.config)).expect("settings");
        let recorder = std::sync::Arc::new(Recorder::default());
        let submission = Handed::to(
            Transitions::new(store.clone(), app.queues.clone()),
            recorder.clone(),
        );
        Self {
            wf: settings.workflow("three").expect("workflow"),
            store,
            status,
            recorder,
            submission,
        }
    }

    /// A scheduler that keeps orders.
    fn keeping(&self, app: &TestApp) -> Handed {
        Handed::to(
            Transitions::new(self.store.clone(), app.queues.clone()).keeping_orders(100),
            self.recorder.clone(),
        )
    }

    /// A new order, started: its id and its first step's request.
    async fn start(&self) -> (Uuid, StepRequest) {
        let mut order = one_step_order(self.status.clone());
        order.workflow = "three".into();
        let started = self
            .submission
            .submit_and_start(&Actor::new_instance("submission"), &[(&order, &self.wf)])
            .await
            .expect("submit");
        assert_eq!(started, [Submitted::Created { started: true }]);
        (order.order_id, request_of(&self.recorder.take().await))
    }
}

/// The reply that step `step`, asked for by `request`, succeeded.
fn succeeded(request: &StepRequest, step: i32) -> StepReply {
    StepReply::to(
        request,
        StepOutcome::Succeeded {
            result: json!({ "step": step }),
        },
    )
}

/// The order's process state as stored.
async fn state_of(app: &TestApp, order_id: Uuid) -> String {
    sqlx::query_scalar("SELECT process_state FROM orders WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(&app.db)
        .await
        .expect("state")
}

#[tokio::test]
async fn a_reply_to_an_order_its_scheduler_keeps_costs_one_round_trip_and_a_changed_order_is_loaded_again()
 {
    // (Counted: the statements sqlx logs.) The first reply loads the
    // order the submission started; its write-back returns the version it
    // left the order at, and the scheduler keeps the order, which the next
    // replies find without a load. Written since by anyone else, the
    // order's guard refuses the kept version, and the reply is applied to
    // the order loaded.
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let started = Started::new(&app, "kept").await;
    let scheduler = started.keeping(&app);
    let me = Actor::new_instance("scheduler");
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    for meanwhile in ["nothing", "a write", "an event"] {
        let (order_id, mut request) = started.start().await;
        let mut costs = Vec::new();
        for step in 0..3 {
            if step == 2 && meanwhile == "a write" {
                // A write by another process: the row's version moves on.
                sqlx::query("UPDATE orders SET priority = priority WHERE order_id = $1")
                    .bind(order_id)
                    .execute(&app.db)
                    .await
                    .expect("touch");
            }
            if step == 2 && meanwhile == "an event" {
                // Another process's transition logged the order's next
                // event: the kept order's event, numbered the same, runs
                // into it before the version guard.
                sqlx::query(
                    "WITH o AS (UPDATE orders SET last_seq = last_seq + 1 \
                       WHERE order_id = $1 RETURNING order_id, last_seq) \
                     INSERT INTO order_events (order_id, seq, event, to_state, attempt, actor, at) \
                     SELECT order_id, last_seq, 'note', 'processing', 1, 'other', now() FROM o",
                )
                .bind(order_id)
                .execute(&app.db)
                .await
                .expect("event");
            }
            trips.take();
            let applied = scheduler
                .apply_reply(&me, &succeeded(&request, step))
                .await
                .expect("reply");
            assert!(
                matches!(applied, ReplyOutcome::Applied { .. }),
                "{applied:?}"
            );
            costs.push(trips.take());
            let published = started.recorder.take().await;
            if step < 2 {
                request = request_of(&published);
                assert_eq!(request.step_index, step + 1);
            }
        }
        assert_eq!(state_of(&app, order_id).await, "processed");
        let expected = if meanwhile == "nothing" {
            [2, 1, 1]
        } else {
            // The refused write-back, then the load and the write-back.
            [2, 1, 3]
        };
        assert_eq!(
            costs, expected,
            "the first reply loads; the kept order's replies only write back ({meanwhile} meanwhile)"
        );
        assert_eq!(scheduler.t.kept(), 0, "an ended order is not kept");
    }
    started.store.close().await;
}

#[tokio::test]
async fn a_reply_to_an_order_moved_on_elsewhere_or_a_duplicate_is_judged_on_the_order_loaded() {
    // (Counted: the statements sqlx logs.) Two schedulers: the first keeps
    // the order after the first reply, the second applies the next one and
    // keeps it in turn. A duplicate of that reply at the second is judged
    // stale on the order as kept, a judgement its write-back would not
    // check (it writes nothing): it is made again on the order loaded. The
    // third reply, at the first, answers a request its kept order never
    // sent: the order is loaded, not judged as kept.
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let started = Started::new(&app, "stale").await;
    let (first, second) = (started.keeping(&app), started.keeping(&app));
    let me = Actor::new_instance("scheduler");
    let (order_id, mut request) = started.start().await;
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let mut costs = Vec::new();
    for (step, scheduler) in [(0, &first), (1, &second), (2, &first)] {
        let reply = succeeded(&request, step);
        trips.take();
        let applied = scheduler.apply_reply(&me, &reply).await.expect("reply");
        assert!(
            matches!(applied, ReplyOutcome::Applied { .. }),
            "step {step}: {applied:?}"
        );
        costs.push(trips.take());
        let published = started.recorder.take().await;
        if step == 1 {
            // (Not counted: the release of the hand-over just taken.)
            trips.take();
            let again = second.apply_reply(&me, &reply).await.expect("again");
            assert!(matches!(again, ReplyOutcome::Stale(_)), "{again:?}");
            assert_eq!(trips.take(), 1, "the load, and nothing to write");
            // A load takes no outbox lock: nothing to let go.
            started.recorder.take().await;
            assert_eq!(trips.take(), 0, "no release");
        }
        if step < 2 {
            request = request_of(&published);
        }
    }
    assert_eq!(
        costs,
        [2, 2, 2],
        "each reply loads its order: none answers what a kept order sent"
    );
    assert_eq!(state_of(&app, order_id).await, "processed");
    started.store.close().await;
}

#[tokio::test]
async fn the_room_a_start_reads_with_its_write_back_holds_the_breakers_the_next_start_judges_by() {
    // (Counted: the statements sqlx logs.) With the first step's agent
    // under an open breaker, a start reads the room, leaves its order
    // pending, and its write-back reads the room again as it leaves it:
    // the next start, in that room, reads nothing first and still sees the
    // breaker (a room read without it would start the order).
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let started = Started::new(&app, "room").await;
    sqlx::query("INSERT INTO breakers (agent, state, opened_at) VALUES ('a', 'open', now())")
        .execute(&app.db)
        .await
        .expect("open the breaker");
    let submission = Handed::to(
        Transitions::new(started.store.clone(), app.queues.clone())
            .keeping_room_for(std::time::Duration::from_secs(3600)),
        started.recorder.clone(),
    );
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let me = Actor::new_instance("submission");
    let mut costs = Vec::new();
    for _ in 0..2 {
        let mut order = one_step_order(started.status.clone());
        order.workflow = "three".into();
        trips.take();
        let submitted = submission
            .submit_and_start(&me, &[(&order, &started.wf)])
            .await
            .expect("submit");
        costs.push(trips.take());
        assert_eq!(submitted, [Submitted::Created { started: false }]);
        started.recorder.take().await;
        assert_eq!(state_of(&app, order.order_id).await, "pending");
    }
    assert_eq!(costs[1], 1, "the second start reads no room of its own");
    started.store.close().await;
}

/// A relay's pass over `ids` ([`StateStore::take_outbox`]), every message
/// published: the orders another publisher held, and the messages taken.
async fn relay_pass(store: &StateStore, ids: &[Uuid], wait: bool) -> (Vec<Uuid>, Vec<OutboxRow>) {
    let taken = store.take_outbox(ids, wait).await.expect("take");
    let published: Vec<i64> = taken.rows.iter().map(|r| r.id).collect();
    taken.held.release(&published).await.expect("release");
    (taken.busy, taken.rows)
}

/// Submits `order`, claims it for `me`, and returns its step request as the
/// outbox holds it.
async fn submit_and_claim(
    app: &TestApp,
    t: &Handed,
    wf: &sas::workflow::Workflow,
    me: &Actor,
    order: &NewOrder,
) -> StepRequest {
    t.submit(order, wf).await.expect("submit");
    assert_eq!(
        t.claim(me, 1, 1).await.expect("claim"),
        vec![order.order_id]
    );
    let request: Vec<u8> =
        sqlx::query_scalar("SELECT body FROM outbox WHERE order_id = $1 AND kind = 'request'")
            .bind(order.order_id)
            .fetch_one(&app.db)
            .await
            .expect("request");
    serde_json::from_slice(&request).expect("request bytes intact")
}

/// Text that would break a badly quoted literal: the write-back sends its
/// arguments as literals in a simple query.
const AWKWARD: &str = "it's \\ a '); DROP TABLE orders; -- $$ \"quoted\" \\x00 ünïcödé \u{1F980}\n";

#[tokio::test]
async fn text_that_looks_like_sql_goes_through_the_write_back_unchanged() {
    let app = TestApp::new().await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let status = app.status_queue("awkward").await;
    let store = StateStore::connect_with(&settings.database, "awkward", Plans::Generic)
        .await
        .expect("connect");
    let t = Handed::plain(Transitions::new(store.clone(), app.queues.clone()));
    let me = Actor::new_instance("scheduler");
    let mut payload = json!({});
    payload[AWKWARD] = json!([AWKWARD, 1.5, null, { "n": -7 }]);
    let mut order = one_step_order(format!("{status}{AWKWARD}"));
    order.payload = payload.clone();
    order.trace_id = Some(AWKWARD.into());
    let request = submit_and_claim(&app, &t, &wf, &me, &order).await;
    assert_eq!(request.payload, payload);
    let reply = StepReply::to(
        &request,
        StepOutcome::Failed {
            error: AWKWARD.into(),
        },
    );
    let applied = t.apply_reply(&me, &reply).await.expect("reply");
    assert!(
        matches!(applied, ReplyOutcome::Applied { .. }),
        "{applied:?}"
    );
    let (stored, reply_to, trace): (serde_json::Value, Option<String>, Option<String>) =
        sqlx::query_as("SELECT payload, reply_to, trace_id FROM orders WHERE order_id = $1")
            .bind(order.order_id)
            .fetch_one(&app.db)
            .await
            .expect("order");
    assert_eq!(stored, payload);
    assert_eq!(reply_to, order.reply_to);
    assert_eq!(trace.as_deref(), Some(AWKWARD));
    let error: Option<String> =
        sqlx::query_scalar("SELECT error FROM steps WHERE order_id = $1 AND idx = 0")
            .bind(order.order_id)
            .fetch_one(&app.db)
            .await
            .expect("step");
    assert_eq!(error.as_deref(), Some(AWKWARD));
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&app.db)
        .await
        .expect("orders still there");
    assert_eq!(tables, 1);
    store.close().await;
}

/// A reply whose task is cancelled while its write-back waits for the
/// order's row leaves no transaction open in the pool, and the reply counts
/// once: the cancelled write-back either commits or writes nothing, and the
/// reply applied again finds the order as it left it.
#[tokio::test]
async fn a_reply_cancelled_while_its_write_back_waits_counts_once_and_leaves_no_transaction_open() {
    let app = TestApp::new().await;
    let settings = Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let status = app.status_queue("cancelled").await;
    let mut database = settings.database.clone();
    database.max_connections = 1;
    let store = StateStore::connect_with(&database, "cancelled", Plans::Generic)
        .await
        .expect("connect");
    let t = Handed::plain(Transitions::new(store.clone(), app.queues.clone()));
    let me = Actor::new_instance("scheduler");
    let order = one_step_order(status);
    let request = submit_and_claim(&app, &t, &wf, &me, &order).await;
    let reply = StepReply::to(
        &request,
        StepOutcome::Succeeded {
            result: json!({ "ok": true }),
        },
    );
    // Someone else holds the order's row: the reply's write-back waits for
    // it, and the task is dropped right there.
    let mut other = PgConnection::connect(&app.db_url).await.expect("connect");
    let mut tx = other.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE")
        .bind(order.order_id)
        .execute(&mut *tx)
        .await
        .expect("lock");
    let waiting = tokio::spawn({
        let (t, me, reply) = (t.clone(), me.clone(), reply.clone());
        async move { t.apply_reply(&me, &reply).await }
    });
    app.wait_for_lock_waiters(1).await;
    waiting.abort();
    assert!(waiting.await.is_err(), "cancelled while it waited");
    tx.rollback().await.expect("rollback");
    // The pool's connection applies the reply again: applied now, or
    // stale if the cancelled write-back went through.
    let again = t.apply_reply(&me, &reply).await.expect("reply");
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cancelled' \
           AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&app.db)
    .await
    .expect("activity");
    assert_eq!(open, 0, "a transaction was left open in the pool");
    assert!(
        matches!(again, ReplyOutcome::Applied { .. })
            || again == ReplyOutcome::Stale("order is processed".into()),
        "{again:?}"
    );
    let succeeded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events WHERE order_id = $1 AND event = 'step_succeeded'",
    )
    .bind(order.order_id)
    .fetch_one(&app.db)
    .await
    .expect("events");
    assert_eq!(succeeded, 1, "the reply counted once");
    store.close().await;
}

/// Deliveries whose handlers finish together (a batch committed at once)
/// share acknowledgement frames, in whatever order the handlers finish, and
/// rejections among them go out on their own without upsetting the broker
/// (a multiple ack that covered a rejected delivery would close the channel).
#[tokio::test]
async fn deliveries_finished_together_share_a_few_ack_frames_and_all_are_settled() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use sas::broker::{self, Outgoing, SessionEnd};
    use tokio_util::sync::CancellationToken;

    const M: usize = 64;
    let app = TestApp::new().await;
    let queue = app.status_queue("acks").await;
    let publisher = app.publisher();
    for i in 0..M {
        publisher
            .publish(&Outgoing {
                routing_key: &queue,
                body: i.to_string().as_bytes(),
                ..Outgoing::default()
            })
            .await
            .expect("published");
    }
    let subscription = app.subscribe(&queue, M as u16).await;
    let acks = subscription.acks();
    // Every handler waits until all M are in, then they finish together in
    // the order they came, as the handlers of a batch do when its commit
    // wakes them; every tenth is dead-lettered.
    let batch: std::sync::Arc<std::sync::Mutex<Vec<tokio::sync::oneshot::Sender<()>>>> =
        Default::default();
    let finished = std::sync::Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let end = broker::consume(
        subscription,
        &stop,
        &CancellationToken::new(),
        Duration::from_secs(5),
        |delivery| {
            let (batch, finished, stop) = (batch.clone(), finished.clone(), stop.clone());
            let (commit, committed) = tokio::sync::oneshot::channel();
            {
                let mut batch = batch.lock().unwrap();
                batch.push(commit);
                if batch.len() == M {
                    for commit in batch.drain(..) {
                        commit.send(()).unwrap();
                    }
                }
            }
            async move {
                committed.await.unwrap();
                if delivery.tag() % 10 == 0 {
                    broker::dead_letter(&delivery).await?;
                } else {
                    broker::ack(&delivery).await?;
                }
                if finished.fetch_add(1, Ordering::SeqCst) + 1 == M {
                    stop.cancel();
                }
                Ok(())
            }
        },
    )
    .await;
    assert!(
        matches!(end, Ok(SessionEnd::Shutdown)),
        "the consumer ended with {end:?}"
    );
    let rejected = (1..=M as u64).filter(|t| t % 10 == 0).count() as u64;
    assert_eq!(acks.acked(), M as u64 - rejected);
    // At best one multiple ack per run of acks between two rejections
    // (seven runs), and one for the first delivery, acknowledged alone
    // while the rest were still coming.
    assert!(
        acks.ack_frames() <= 10,
        "{} ack frames for {} acknowledged deliveries",
        acks.ack_frames(),
        acks.acked()
    );
    // Nothing came back when the channel closed: every delivery was settled.
    assert_eq!(app.ready(&queue).await, 0);
}

/// A delivery handed back behind one still being worked on goes back to the
/// queue at once (another consumer may take it), not when the slow one ends:
/// here the slow one ends only once the handed-back message came again.
#[tokio::test]
async fn a_hand_back_behind_a_slow_delivery_goes_back_at_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use sas::broker::{self, Outgoing, SessionEnd};
    use tokio_util::sync::CancellationToken;

    let app = TestApp::new().await;
    let queue = app.status_queue("handback").await;
    let publisher = app.publisher();
    for body in ["slow", "back", "fast"] {
        publisher
            .publish(&Outgoing {
                routing_key: &queue,
                body: body.as_bytes(),
                ..Outgoing::default()
            })
            .await
            .expect("published");
    }
    let subscription = app.subscribe(&queue, 8).await;
    let came_again = std::sync::Arc::new(tokio::sync::Notify::new());
    let settled = std::sync::Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let end = tokio::time::timeout(
        Duration::from_secs(20),
        broker::consume(
            subscription,
            &stop,
            &CancellationToken::new(),
            Duration::from_secs(5),
            |delivery| {
                let (came_again, settled, stop) =
                    (came_again.clone(), settled.clone(), stop.clone());
                async move {
                    match (delivery.body(), delivery.redelivered()) {
                        (b"slow", _) => {
                            came_again.notified().await;
                            broker::ack(&delivery).await?;
                        }
                        (b"back", false) => broker::requeue(&delivery).await?,
                        (b"back", true) => {
                            broker::ack(&delivery).await?;
                            came_again.notify_one();
                        }
                        _ => broker::ack(&delivery).await?,
                    }
                    // slow, fast and back (the second time) acknowledged.
                    if settled.fetch_add(1, Ordering::SeqCst) + 1 == 4 {
                        stop.cancel();
                    }
                    Ok(())
                }
            },
        ),
    )
    .await
    .expect("the handed-back message came again while the slow one waited for it");
    assert!(
        matches!(end, Ok(SessionEnd::Shutdown)),
        "the consumer ended with {end:?}"
    );
    assert_eq!(app.ready(&queue).await, 0);
}

/// sqlx 0.9.0 left Nagle's algorithm on for its Postgres connections, and a
/// query written in two parts then waited for the server's delayed ACK: 40
/// ms a time, most of the p50 at 10% load (docs/performance.md, "The regular
/// 10%-load delay was Nagle's algorithm"). sas carries
/// the fix (`third_party/sqlx-core`); this reads the option off this
/// process's own socket to the server, the one a connection just opened.
#[tokio::test]
async fn postgres_connections_have_nagle_off() {
    use std::os::fd::BorrowedFd;

    let options: sqlx::postgres::PgConnectOptions =
        sas_tests::pg_admin().parse().expect("the admin URL");
    let server: std::net::SocketAddr = format!("{}:{}", options.get_host(), options.get_port())
        .parse()
        .expect("the admin URL names an IP address");
    let conn = PgConnection::connect_with(&options).await.expect("connect");
    let mut to_server = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd") {
        let Some(fd) = entry
            .ok()
            .and_then(|e| e.file_name().to_str()?.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: the descriptor is only asked for socket options while
        // this function runs; one closed meanwhile answers with an error.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&fd);
        if socket.peer_addr().ok().and_then(|a| a.as_socket()) == Some(server) {
            to_server.push(socket.tcp_nodelay().expect("TCP_NODELAY"));
        }
    }
    conn.close().await.ok();
    assert!(!to_server.is_empty(), "no socket to {server} found");
    assert!(
        to_server.iter().all(|&off| off),
        "Nagle's algorithm on for a Postgres connection: {to_server:?}"
    );
}

/// Has `me` last beat a minute ago: gone, as far as the relays can tell.
async fn silence(app: &TestApp, me: &Actor) {
    sqlx::query(
        "UPDATE instances SET last_seen = now() - interval '1 minute' WHERE instance_id = $1",
    )
    .bind(&me.name)
    .execute(&app.db)
    .await
    .expect("silence");
}

/// Order `order_id`'s step requests in the outbox, and whom each is handed to.
async fn requests_kept(app: &TestApp, order_id: Uuid) -> Vec<Option<String>> {
    sqlx::query_scalar("SELECT handed_to FROM outbox WHERE order_id = $1 AND kind = 'request'")
        .bind(order_id)
        .fetch_all(&app.db)
        .await
        .expect("outbox")
}

/// A submission and a scheduler that publish as instances that beat (a
/// service's relay, [`sas::outbox::Relay::publishing_as`]), over one
/// connection, with a one-step order with terminal events to start.
struct Beating {
    wf: Workflow,
    order: NewOrder,
    store: StateStore,
    submission: Actor,
    started: Handed,
    starts: std::sync::Arc<Recorder>,
    scheduler: Actor,
    replies: Handed,
    replied: std::sync::Arc<Recorder>,
}

impl Beating {
    async fn new(app: &TestApp, queue: &str) -> Self {
        Self::running(app, queue, "one").await
    }

    /// As [`Beating::new`], its orders running `workflow`, the scheduler
    /// keeping the orders that wait for its replies (as a service's does).
    async fn running(app: &TestApp, queue: &str, workflow: &str) -> Self {
        let (_, status, store, _) = one_connection(app, queue).await;
        Self::on(app, status, workflow, store).await
    }

    /// As [`Beating::running`], over `store`, its orders' events going to
    /// `status`.
    async fn on(app: &TestApp, status: String, workflow: &str, store: StateStore) -> Self {
        let settings = Settings::load(Some(&app.config)).expect("settings");
        let wf = settings.workflow(workflow).expect("workflow");
        let (submission, scheduler) = (
            Actor::new_instance("submission"),
            Actor::new_instance("scheduler"),
        );
        let handing = |me: &Actor| {
            let recorder = std::sync::Arc::new(Recorder {
                instance: Some(me.name.clone()),
                ..Recorder::default()
            });
            let t = Handed::to(
                Transitions::new(store.clone(), app.queues.clone())
                    .keeping_room_for(std::time::Duration::from_secs(3600))
                    .keeping_orders(100),
                recorder.clone(),
            );
            (t, recorder)
        };
        let ((started, starts), (replies, replied)) = (handing(&submission), handing(&scheduler));
        for me in [&submission, &scheduler] {
            store.heartbeat(&me.name, "costs").await.expect("beat");
        }
        let mut order = one_step_order(status);
        order.events = Events::Terminal;
        order.workflow = workflow.into();
        Self {
            wf,
            order,
            store,
            submission,
            started,
            starts,
            scheduler,
            replies,
            replied,
        }
    }

    /// A test deployment's [`Beating`] (one-step orders), and a store of its
    /// own for relays' passes.
    async fn with_relays(queue: &str) -> (TestApp, Self, StateStore) {
        let app = TestApp::new().await;
        let b = Self::new(&app, queue).await;
        let relays = StateStore::from_pool(pool(&app.db_url).await);
        (app, b, relays)
    }

    /// `n` new orders like [`Beating::order`], each with an id of its own.
    fn orders(&self, n: usize) -> Vec<NewOrder> {
        (0..n)
            .map(|_| NewOrder {
                order_id: Uuid::new_v4(),
                ..self.order.clone()
            })
            .collect()
    }

    /// Stores `orders` in one batch, starting them while their step
    /// requests stay under `requests`.
    async fn start_under(&self, requests: u32, orders: &[NewOrder]) -> Vec<Submitted> {
        let batch: Vec<(&NewOrder, &Workflow)> = orders.iter().map(|o| (o, &self.wf)).collect();
        self.started
            .t
            .submit_and_start(&self.submission, 1000, requests, &batch)
            .await
            .expect("submit")
    }

    /// A new order like [`Beating::order`], started: what it published.
    async fn start(&self) -> (NewOrder, Vec<OutboxRow>) {
        let order = self.orders(1).remove(0);
        let submitted = self
            .started
            .submit_and_start(&self.submission, &[(&order, &self.wf)])
            .await
            .expect("submit");
        assert_eq!(submitted, [Submitted::Created { started: true }]);
        (order, self.starts.take().await)
    }
}

#[tokio::test]
async fn a_one_step_order_started_by_a_submission_that_beats_costs_three_statements_its_reply_deletes_its_request_and_the_next_write_back_its_event()
 {
    // (Counted: the statements sqlx logs.) Its request alone goes out at
    // once, handed to the submission's instance: no outbox lock, no delete.
    // The reply's load and write-back (which deletes the request); its
    // terminal event goes out handed to the scheduler's instance, and the
    // scheduler's next write-back deletes it once confirmed: three in all,
    // from five.
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let b = Beating::new(&app, "handed").await;
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let (mut costs, mut ids) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        trips.take();
        let (order, published) = b.start().await;
        let start = trips.take();
        let kinds: Vec<(&str, bool)> = published
            .iter()
            .map(|r| (r.kind.as_str(), r.handed))
            .collect();
        assert_eq!(kinds, [("request", true)], "the request alone, handed");
        assert_eq!(
            requests_kept(&app, order.order_id).await,
            [Some(b.submission.name.clone())],
            "kept until its reply, handed to the submission"
        );
        let request = request_of(&published);
        trips.take();
        let applied = b
            .replies
            .apply_reply(&b.scheduler, &succeeded(&request, 0))
            .await
            .expect("reply");
        assert!(
            matches!(applied, ReplyOutcome::Applied { .. }),
            "{applied:?}"
        );
        let ended = b.replied.take().await;
        let reply = trips.take();
        let kinds: Vec<(&str, bool)> = ended.iter().map(|r| (r.kind.as_str(), r.handed)).collect();
        assert_eq!(kinds, [("status", true)], "the terminal event, handed");
        assert_eq!(
            requests_kept(&app, order.order_id).await,
            Vec::<Option<String>>::new()
        );
        assert_eq!(state_of(&app, order.order_id).await, "processed");
        ids.push(order.order_id);
        costs.push((start, reply));
    }
    assert_eq!(
        &costs[1..],
        [(1, 2), (1, 2)],
        "the start's write-back; the reply's load and write-back"
    );
    // Each terminal event stayed, handed to the scheduler, until its next
    // write-back: the last one's until the relay deletes it.
    let db = &app.db;
    let events = |id: Uuid| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT handed_to FROM outbox WHERE order_id = $1 AND kind = 'status'",
        )
        .bind(id)
        .fetch_all(db)
        .await
        .expect("events")
    };
    assert_eq!(events(ids[0]).await, Vec::<String>::new());
    assert_eq!(events(ids[1]).await, Vec::<String>::new());
    assert_eq!(
        events(ids[2]).await,
        std::slice::from_ref(&b.scheduler.name)
    );
    let left = b.replied.take_published();
    b.store.delete_published(&left).await.expect("delete");
    assert_eq!(events(ids[2]).await, Vec::<String>::new());
    b.store.close().await;
}

#[tokio::test]
async fn a_handed_request_is_sent_again_only_once_its_publisher_stops_beating_or_hands_it_back_and_never_once_superseded()
 {
    let (app, b, relays) = Beating::with_relays("handed-again").await;
    let pass = async |ids: &[Uuid]| {
        let (busy, rows) = relay_pass(&relays, ids, false).await;
        assert!(busy.is_empty(), "no other relay runs");
        rows.iter().map(|r| r.kind.clone()).collect::<Vec<_>>()
    };
    // Handed to an instance that beats: no relay's pass nor sweep sends it.
    let id = b.start().await.0.order_id;
    assert_eq!(pass(&[id]).await, Vec::<String>::new(), "sent already");
    let stale = relays.outbox_stale_orders(0, 10).await.expect("stale");
    assert!(!stale.contains(&id), "the sweep passes it by");
    assert_eq!(relays.outbox_backlog().await.expect("backlog"), 0);
    // Its publisher stopped beating: sent again, then deleted.
    silence(&app, &b.submission).await;
    assert_eq!(
        relays.outbox_stale_orders(0, 10).await.expect("stale"),
        [id]
    );
    assert_eq!(pass(&[id]).await, ["request"], "its publisher is gone");
    assert_eq!(requests_kept(&app, id).await, Vec::<Option<String>>::new());
    // Handed back (its hand-over could not send it): any relay sends it.
    b.store
        .heartbeat(&b.submission.name, "costs")
        .await
        .expect("beat");
    let back = b.start().await.0;
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox WHERE order_id = $1 AND kind = 'request'")
            .bind(back.order_id)
            .fetch_all(&app.db)
            .await
            .expect("ids");
    relays.unhand_outbox(&ids).await.expect("unhand");
    assert_eq!(pass(&[back.order_id]).await, ["request"], "handed back");
    // Superseded (its step dispatched again, or answered elsewhere):
    // never sent again, even with its publisher gone, and swept away.
    let superseded = b.start().await.0;
    sqlx::query("UPDATE steps SET dispatch_id = gen_random_uuid() WHERE order_id = $1")
        .bind(superseded.order_id)
        .execute(&app.db)
        .await
        .expect("dispatch again");
    sqlx::query("UPDATE outbox SET handed_to = NULL WHERE order_id = $1")
        .bind(superseded.order_id)
        .execute(&app.db)
        .await
        .expect("unhanded");
    assert_eq!(pass(&[superseded.order_id]).await, Vec::<String>::new());
    assert!(
        !relays
            .outbox_stale_orders(0, 10)
            .await
            .expect("stale")
            .contains(&superseded.order_id)
    );
    assert_eq!(relays.outbox_drop_superseded(0).await.expect("drop"), 1);
    assert_eq!(
        requests_kept(&app, superseded.order_id).await,
        Vec::<Option<String>>::new()
    );
    relays.close().await;
    b.store.close().await;
}

#[tokio::test]
async fn an_event_handed_to_a_publisher_holds_back_its_orders_later_messages_until_deleted_or_its_publisher_is_gone()
 {
    let (app, b, relays) = Beating::with_relays("handed-event").await;
    // An order ended, its terminal event handed to the scheduler, and a
    // later message of it (an operator's, say) left to the relays.
    let ended = async || {
        let (order, published) = b.start().await;
        let reply = succeeded(&request_of(&published), 0);
        let applied = b
            .replies
            .apply_reply(&b.scheduler, &reply)
            .await
            .expect("reply");
        assert!(matches!(applied, ReplyOutcome::Applied { .. }));
        b.replied.take().await;
        sqlx::query(
            "INSERT INTO outbox (order_id, kind, routing_key, body) \
             VALUES ($1, 'status', 'later', '\\x7b7d')",
        )
        .bind(order.order_id)
        .execute(&app.db)
        .await
        .expect("later");
        order.order_id
    };
    let pass = async |id: Uuid| {
        let (busy, rows) = relay_pass(&relays, &[id], false).await;
        let kinds: Vec<String> = rows.iter().map(|r| r.routing_key.clone()).collect();
        (busy, kinds)
    };
    let deleted = ended().await;
    assert_eq!(pass(deleted).await, (vec![deleted], vec![]), "held back");
    assert_eq!(pass(deleted).await, (vec![deleted], vec![]), "still");
    let confirmed = b.replied.take_published();
    relays.delete_published(&confirmed).await.expect("delete");
    assert_eq!(pass(deleted).await, (vec![], vec!["later".to_owned()]));
    // Its publisher stopped beating: the event goes again, then the later one.
    let gone = ended().await;
    assert_eq!(pass(gone).await, (vec![gone], vec![]), "held back");
    silence(&app, &b.scheduler).await;
    let (busy, kinds) = pass(gone).await;
    assert!(busy.is_empty());
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert_eq!(kinds[1], "later", "in order");
    relays.close().await;
    b.store.close().await;
}

#[tokio::test]
async fn a_three_step_order_started_by_a_submission_that_beats_costs_five_statements() {
    // (Counted: the statements sqlx logs.) The start's write-back; the
    // first reply's load (the order is the submission's, not kept) and
    // write-back; then one write-back per reply, on the order kept.
    use tracing_subscriber::layer::SubscriberExt as _;
    let app = TestApp::new().await;
    let b = Beating::running(&app, "handed-three", "three").await;
    let trips = RoundTrips::default();
    let _counting =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(trips.clone()));
    let mut costs = Vec::new();
    for _ in 0..2 {
        trips.take();
        let (order, mut published) = b.start().await;
        let mut cost = vec![trips.take()];
        for step in 0..3 {
            let request = request_of(&published);
            trips.take();
            let applied = b
                .replies
                .apply_reply(&b.scheduler, &succeeded(&request, step))
                .await
                .expect("reply");
            assert!(
                matches!(applied, ReplyOutcome::Applied { .. }),
                "{applied:?}"
            );
            published = b.replied.take().await;
            cost.push(trips.take());
        }
        assert_eq!(state_of(&app, order.order_id).await, "processed");
        costs.push(cost);
    }
    assert_eq!(costs[1], [1, 2, 1, 1], "five in all");
    b.store.close().await;
}

#[tokio::test]
async fn a_one_step_order_puts_four_messages_through_the_broker_of_which_only_the_order_and_its_terminal_event_are_persistent()
 {
    // RabbitMQ writes to disk (and syncs) only persistent messages in
    // durable queues: of a one-step order's four messages (the order, its
    // request, the reply, its terminal event), two. The step messages are
    // transient by default: Postgres holds every step, and a broker
    // restart that drops them sends them again at once (#58). Each message
    // is held in its queue on the way (the next service stopped) and
    // looked at there; then the order goes on.
    use sas_client::Order;
    let app = TestApp::builder().step_timeout("60s").build().await;
    app.start_all().await;
    app.terminate("agent").await;
    let status = app.status_queue("messages").await;
    let mut order = Order::new("one", serde_json::Map::new());
    order.reply_to = Some(status.clone());
    order.events = Events::Terminal;
    let id = app.client().submit_order(order).await.expect("submit").id();
    let requests = app.queues.agent_requests("a");
    let waiting = |queue: String| {
        let app = &app;
        async move {
            app.eventually(
                &format!("one message waits in {queue}"),
                std::time::Duration::from_secs(20),
                || async { app.ready(&queue).await == 1 },
            )
            .await;
            let taken = app.take(&queue).await.expect("the message");
            let persistent = taken.delivery.persistent();
            taken.release().await.expect("put back");
            persistent
        }
    };
    assert!(
        !waiting(requests.clone()).await,
        "the step request is transient"
    );
    app.terminate("scheduler").await;
    app.start("agent", "agent", &[]).await;
    let replies = app.queues.replies().to_owned();
    assert!(!waiting(replies.clone()).await, "the reply is transient");
    app.start("scheduler", "scheduler", &[]).await;
    app.eventually(
        "it ends processed",
        std::time::Duration::from_secs(30),
        || async {
            app.order(id)
                .await
                .is_some_and(|(state, _)| state == "processed")
        },
    )
    .await;
    app.eventually(
        "its terminal event waits",
        std::time::Duration::from_secs(20),
        || async { app.ready(&status).await >= 1 },
    )
    .await;
    let event = app.take(&status).await.expect("the event");
    assert!(event.delivery.persistent(), "a status event is persistent");
    let body: serde_json::Value = serde_json::from_slice(event.delivery.body()).expect("JSON");
    assert_eq!(body["state"], "processed", "{body}");
    event.ack().await.expect("ack");
    // Nothing else went through: the terminal event alone, and no step
    // message left behind.
    for queue in [&status, &requests, &replies] {
        assert_eq!(app.ready(queue).await, 0, "{queue}");
    }
}

/// On the server `admin` is connected to, counted for the whole server:
/// the transactions that wrote so far (the next transaction id; reading it
/// takes none), and the syncs of the write-ahead log to disk
/// (`pg_stat_wal`), once the counts hold still.
async fn writes_and_syncs(admin: &sqlx::PgPool) -> (i64, i64) {
    settled(async || {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, wal_sync \
             FROM pg_stat_wal",
        )
        .fetch_one(admin)
        .await
        .expect("pg_stat_wal")
    })
    .await
}

#[tokio::test]
async fn a_one_step_order_started_by_a_submission_that_beats_waits_for_postgres_to_sync_twice() {
    // Counted by a server of the test's own, which syncs its disk and on
    // which nothing else writes: no checkpoint, autovacuum or snapshot
    // record comes in between. Of the order's three statements, the two
    // write-backs wait for the disk; the reply's load writes nothing.
    let app = TestApp::new().await;
    let pg = tokio::task::spawn_blocking(|| {
        sas_tests::postgres::OwnPostgres::start_with(
            None,
            "fsync = on\nsynchronous_commit = on\nwal_level = minimal\nmax_wal_senders = 0\n\
             wal_writer_delay = 10000ms\nautovacuum = off\ncheckpoint_timeout = 1h\n",
        )
    })
    .await
    .expect("the test's own server");
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg.url("postgres", ""))
        .await
        .expect("the test's own server");
    sqlx::query("CREATE DATABASE sas")
        .execute(&admin)
        .await
        .expect("create database");
    let url = pg.url("sas", "");
    let mut database = Settings::load(Some(&app.config))
        .expect("settings")
        .database;
    database.url = url.clone();
    StateStore::connect_with(&database, "costs", Plans::Generic)
        .await
        .expect("migrate")
        .close()
        .await;
    let conn = pool(&url).await;
    let status = app.status_queue("synced").await;
    let b = Beating::on(&app, status, "one", StateStore::from_pool(conn.clone())).await;
    // The order's connection reports what it counted once idle: asked to
    // now, rather than within a second.
    let reported = async || {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&conn)
            .await
            .expect("flush statistics");
    };
    // One order first: the statements are prepared on their first use.
    let run = async || {
        let (_, published) = b.start().await;
        let request = request_of(&published);
        let applied = b
            .replies
            .apply_reply(&b.scheduler, &succeeded(&request, 0))
            .await
            .expect("reply");
        assert!(
            matches!(applied, ReplyOutcome::Applied { .. }),
            "{applied:?}"
        );
        b.replied.take().await;
    };
    run().await;
    reported().await;
    let before = writes_and_syncs(&admin).await;
    const ORDERS: i64 = 10;
    for _ in 0..ORDERS {
        run().await;
    }
    reported().await;
    let after = writes_and_syncs(&admin).await;
    let (writes, syncs) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(
        writes,
        2 * ORDERS,
        "transactions that wrote, for {ORDERS} orders: the two write-backs each"
    );
    // Each of them waited for its own sync (one after the other, no two
    // commits share one). The log-writer syncs too, off any order's path,
    // when a load wrote (pruned a page) and no commit synced it first: on a
    // busy machine, up to once per load.
    assert!(
        (writes..writes + ORDERS).contains(&syncs),
        "{syncs} syncs of the log for {ORDERS} orders: two each, and fewer than one more"
    );
    b.store.close().await;
    admin.close().await;
}

#[tokio::test]
async fn a_submissions_starts_stop_at_their_bound_of_requests_and_the_rest_wait_for_a_claim() {
    // As a scheduler's claim stops at `scheduler.claim_messages`: a burst
    // of fan-out orders (a request per item) never holds a batch times its
    // fan-out in the submission's memory. Under the bound, each order of
    // the batch starts; from it on, they are stored pending.
    let app = TestApp::new().await;
    let b = Beating::running(&app, "bounded", "fanout").await;
    let orders = b.orders(3);
    assert_eq!(
        b.start_under(3, &orders).await,
        [
            Submitted::Created { started: true },
            Submitted::Created { started: false },
            Submitted::Created { started: false },
        ],
        "the first order's requests reach the bound"
    );
    let requests = b
        .starts
        .take()
        .await
        .iter()
        .filter(|r| r.kind == "request")
        .count();
    assert!(
        requests > 3,
        "{requests} requests: the first order fans out"
    );
    assert_eq!(state_of(&app, orders[1].order_id).await, "pending");
    // Unbounded, every order starts.
    assert_eq!(
        b.start_under(u32::MAX, &b.orders(2)).await,
        [Submitted::Created { started: true }; 2]
    );
    b.store.close().await;
}
