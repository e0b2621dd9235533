//! RabbitMQ users of one test (an application's, with the permissions a
//! test gives it), made with `rabbitmqctl` and deleted on drop.

use std::process::Command;

/// Runs `rabbitmqctl` with `args`; panics if it fails.
pub fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A RabbitMQ user on vhost `/`, deleted on drop.
pub struct BrokerUser {
    pub name: String,
    pub password: String,
}

impl BrokerUser {
    /// User `name` with a random password and the `configure`, `write` and
    /// `read` permission patterns on `/`.
    pub fn create(name: &str, configure: &str, write: &str, read: &str) -> Self {
        let password = uuid::Uuid::new_v4().simple().to_string();
        rabbitmqctl(&["add_user", name, &password]);
        rabbitmqctl(&["set_permissions", "-p", "/", name, configure, write, read]);
        Self {
            name: name.to_owned(),
            password,
        }
    }

    /// The user's AMQP URL for the machine's RabbitMQ.
    pub fn url(&self) -> String {
        format!("amqp://{}:{}@127.0.0.1:5672/%2f", self.name, self.password)
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        Command::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.name])
            .output()
            .ok();
    }
}
