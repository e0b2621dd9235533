//! The names of every queue of a deployment, derived from `broker.prefix`
//! (contract §1, §4, §5). Pure: the broker declares them, the state store
//! routes to them, tests and `sasctl` clean them up.

/// Queue names under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueNames {
    prefix: String,
    orders: String,
    orders_dead: String,
    alerts: String,
    replies: String,
    replies_dead: String,
}

impl QueueNames {
    /// The names under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            orders: format!("{prefix}.orders"),
            orders_dead: format!("{prefix}.orders.dead"),
            alerts: format!("{prefix}.alerts"),
            replies: format!("{prefix}.scheduler.replies"),
            replies_dead: format!("{prefix}.scheduler.replies.dead"),
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Where applications publish orders.
    pub fn orders(&self) -> &str {
        &self.orders
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
    pub fn all<'a>(
        &self,
        agents: impl IntoIterator<Item = &'a str>,
    ) -> Vec<(String, Option<String>)> {
        let mut all = vec![
            (self.orders_dead.clone(), None),
            (self.orders.clone(), Some(self.orders_dead.clone())),
            (self.alerts.clone(), None),
            (self.replies_dead.clone(), None),
            (self.replies.clone(), Some(self.replies_dead.clone())),
        ];
        for agent in agents {
            all.push((self.agent_requests_dead(agent), None));
            all.push((
                self.agent_requests(agent),
                Some(self.agent_requests_dead(agent)),
            ));
        }
        all
    }
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
        assert_eq!(q.all(["a"]).len(), 7);
    }
}
