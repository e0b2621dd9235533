//! RabbitMQ users of one test (an application's, with the permissions a
//! test gives it), made with `rabbitmqctl` on the tests' node
//! ([`crate::rabbitmq_cli`]) and deleted on drop.

/// Runs `rabbitmqctl` with `args` against the tests' node; panics if it fails.
pub fn rabbitmqctl(args: &[&str]) {
    let out = crate::rabbitmq_cli("rabbitmqctl")
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

    /// The user's AMQP URL: the tests' broker URL ([`crate::amqp`]) with
    /// this user's name and password.
    pub fn url(&self) -> String {
        let mut url = reqwest::Url::parse(crate::amqp()).expect("the tests' broker URL");
        url.set_username(&self.name).expect("a user name");
        url.set_password(Some(&self.password)).expect("a password");
        url.to_string()
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        crate::rabbitmq_cli("rabbitmqctl")
            .args(["-q", "delete_user", &self.name])
            .output()
            .ok();
    }
}
