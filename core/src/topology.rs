//! The names of every queue of a deployment, derived from `broker.prefix`
//! (contract §1, §4, §5, §9). Pure: the broker declares them, the state store
//! routes to them, tests and `sasctl` clean them up.

/// Queue names under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueNames {
    prefix: String,
    orders: String,
    orders_dead: String,
    submit: String,
    alerts: String,
    replies: String,
    replies_dead: String,
    replay: String,
    replay_dead: String,
    signals: String,
    signals_dead: String,
    children: String,
    children_dead: String,
    children_ended: String,
    children_ended_dead: String,
    marker: String,
}

impl QueueNames {
    /// The names under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            orders: format!("{prefix}.orders"),
            orders_dead: format!("{prefix}.orders.dead"),
            submit: format!("{prefix}.submit"),
            alerts: format!("{prefix}.alerts"),
            replies: format!("{prefix}.scheduler.replies"),
            replies_dead: format!("{prefix}.scheduler.replies.dead"),
            replay: format!("{prefix}.replay"),
            replay_dead: format!("{prefix}.replay.dead"),
            signals: format!("{prefix}.signals"),
            signals_dead: format!("{prefix}.signals.dead"),
            children: format!("{prefix}.children.requests"),
            children_dead: format!("{prefix}.children.requests.dead"),
            children_ended: format!("{prefix}.children.ended"),
            children_ended_dead: format!("{prefix}.children.ended.dead"),
            marker: format!("{prefix}.supervisor.marker"),
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether `queue` is not for applications to name (contract §1b): one
    /// of sas's own (the prefix, or under `<prefix>.`) or the broker's
    /// (`amq.`). An order or replay naming one as its `reply_to` would make
    /// sas publish into its own queues (a replay request replaying into
    /// the replay queue floods the broker) or fake an operator's alert.
    pub fn is_reserved(&self, queue: &str) -> bool {
        sas_protocol::limits::is_reserved_queue(&self.prefix, queue)
    }

    /// Where applications publish orders.
    pub fn orders(&self) -> &str {
        &self.orders
    }

    /// The exchange (fanout, bound to [`QueueNames::orders`]) through which
    /// an application with least privilege submits: it may publish here and
    /// nowhere else (the default exchange reaches every queue).
    pub fn submit_exchange(&self) -> &str {
        &self.submit
    }

    /// Where rejected orders go, with `x-sas-reason`.
    pub fn orders_dead(&self) -> &str {
        &self.orders_dead
    }

    /// Operator alerts.
    pub fn alerts(&self) -> &str {
        &self.alerts
    }

    /// Where agents answer the schedulers: one durable queue that every
    /// scheduler consumes, so a reply outlives the scheduler that asked.
    pub fn replies(&self) -> &str {
        &self.replies
    }

    /// Replies that could not be read.
    pub fn replies_dead(&self) -> &str {
        &self.replies_dead
    }

    /// Where applications ask for stored status events again (contract
    /// §9); the submission service serves it.
    pub fn replay(&self) -> &str {
        &self.replay
    }

    /// Replay requests that could not be served, with `x-sas-reason`.
    pub fn replay_dead(&self) -> &str {
        &self.replay_dead
    }

    /// Where applications send the signals their orders' `signal` steps
    /// wait for (contract §4d); the submission service serves it.
    pub fn signals(&self) -> &str {
        &self.signals
    }

    /// Signals refused, with `x-sas-reason`.
    pub fn signals_dead(&self) -> &str {
        &self.signals_dead
    }

    /// The requests of child workflow steps (contract §4d), for sas's own
    /// agent of children (the submission service): start or undo a child.
    pub fn children(&self) -> &str {
        &self.children
    }

    /// Child requests that could not be read, or were delivered too often.
    pub fn children_dead(&self) -> &str {
        &self.children_dead
    }

    /// Where child orders announce their end (their status queue, the one
    /// queue of sas's own an order may name): the agent of children answers
    /// the parent's step from here.
    pub fn children_ended(&self) -> &str {
        &self.children_ended
    }

    /// Child ends that could not be read.
    pub fn children_ended_dead(&self) -> &str {
        &self.children_ended_dead
    }

    /// The supervisor's marker of RabbitMQ's transient messages: never
    /// consumed, it holds one transient message, which a broker restart
    /// drops with the step messages (`Broker::lost_transient`).
    pub fn marker(&self) -> &str {
        &self.marker
    }

    /// The queue the requests of `agent` go to: its own, or for a child
    /// workflow step (`workflow:<name>`), the children's.
    pub fn requests_of(&self, agent: &str) -> String {
        match crate::workflow::StepKind::of(agent) {
            crate::workflow::StepKind::Child(_) => self.children.clone(),
            _ => self.agent_requests(agent),
        }
    }

    /// The request queue of an agent.
    pub fn agent_requests(&self, agent: &str) -> String {
        format!("{}.agent.{agent}.requests", self.prefix)
    }

    /// Requests to an agent that could not be read, or were delivered too often.
    pub fn agent_requests_dead(&self, agent: &str) -> String {
        format!("{}.agent.{agent}.requests.dead", self.prefix)
    }

    /// Every queue of the deployment for these agents, each work queue with
    /// its dead-letter queue: `(queue, Some(dead-letter queue))`, dead-letter
    /// and alert queues with `None`.
    pub fn all<'a>(&self, agents: impl IntoIterator<Item = &'a str>) -> Vec<Queue> {
        let queue = |name: &str, dead: Option<&str>, step: bool| Queue {
            name: name.to_owned(),
            dead_letters: dead.map(str::to_owned),
            step,
        };
        let mut all = vec![
            queue(&self.orders_dead, None, false),
            queue(&self.orders, Some(&self.orders_dead), false),
            queue(&self.alerts, None, false),
            queue(&self.replies_dead, None, false),
            queue(&self.replies, Some(&self.replies_dead), true),
            queue(&self.replay_dead, None, false),
            queue(&self.replay, Some(&self.replay_dead), false),
            queue(&self.signals_dead, None, false),
            queue(&self.signals, Some(&self.signals_dead), false),
            queue(&self.children_dead, None, false),
            queue(&self.children, Some(&self.children_dead), false),
            queue(&self.children_ended_dead, None, false),
            queue(&self.children_ended, Some(&self.children_ended_dead), false),
        ];
        for agent in agents {
            let dead = self.agent_requests_dead(agent);
            all.push(queue(&dead, None, false));
            all.push(queue(&self.agent_requests(agent), Some(&dead), true));
        }
        all
    }
}

/// A queue of the deployment, as [`QueueNames::all`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queue {
    pub name: String,
    /// Where it dead-letters, for a work queue.
    pub dead_letters: Option<String>,
    /// A step queue (agent requests, replies): of the type `broker.step_queues` says.
    pub step: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        let q = QueueNames::new("t1");
        assert_eq!(q.orders(), "t1.orders");
        assert_eq!(q.orders_dead(), "t1.orders.dead");
        assert_eq!(q.alerts(), "t1.alerts");
        assert_eq!(q.agent_requests("payments"), "t1.agent.payments.requests");
        assert_eq!(q.replay(), "t1.replay");
        assert_eq!(q.replay_dead(), "t1.replay.dead");
        assert_eq!(q.signals(), "t1.signals");
        assert_eq!(q.signals_dead(), "t1.signals.dead");
        assert_eq!(q.requests_of("workflow:ship"), "t1.children.requests");
        assert_eq!(q.requests_of("pay"), "t1.agent.pay.requests");
        assert_eq!(q.all(["a"]).len(), 15);
    }

    #[test]
    fn every_queue_of_the_deployment_and_the_brokers_own_are_reserved() {
        let q = QueueNames::new("t1");
        for queue in q.all(["a", "b"]) {
            assert!(q.is_reserved(&queue.name), "{}", queue.name);
        }
        for reserved in [
            "t1",
            "t1.",
            "t1.replay",
            "t1.x.y",
            "amq.gen-1",
            "amq.rabbitmq.reply-to",
        ] {
            assert!(q.is_reserved(reserved), "{reserved}");
        }
        for free in [
            "t10.orders",
            "t1x",
            "app.t1.replay",
            "shop.status",
            "amq",
            "AMQ.x",
            "T1.replay",
        ] {
            assert!(!q.is_reserved(free), "{free}");
        }
    }
}
