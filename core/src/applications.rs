//! Application identities (contract §1b), pure: who sent a message, which
//! reply queues it may name, and which order an id it gives means.
//!
//! Off unless `[applications.<name>]` is configured. Then:
//! - a message is an application's when its AMQP `user_id` is the
//!   application's RabbitMQ user (RabbitMQ refuses a `user_id` other than the
//!   connection's own, so it cannot be forged); any other is refused;
//! - it may name as `reply_to` only queues matching the application's
//!   patterns (`*` matches any run of characters);
//! - the ids it gives are its own: order `x` of application `a` is stored as
//!   [`Application::order_id`] (the UUIDv5 of `x` in `a`'s namespace), so the
//!   same `x` from two applications is two orders, and no application can
//!   name, squat or replay another's. Its status events still say `x`.
//!
//! A copy that sas itself republishes (a counted retry, a dead letter
//! replayed by `sasctl`) is sent by sas's own user, with the original
//! sender's user in the header `x-sas-user-id`: that header is believed
//! only on a message whose `user_id` is one of sas's own users (which
//! RabbitMQ vouches for, as for any `user_id`), and is the sender then.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use crate::spec::ApplicationSpec;

/// The configured applications.
#[derive(Debug, Clone, Default)]
pub struct Applications {
    /// By RabbitMQ user.
    by_user: BTreeMap<String, Application>,
    /// Whether any is configured: then a message must come from one.
    configured: bool,
    /// sas's own RabbitMQ users: the only ones whose copies may say who
    /// sent the original.
    own_users: BTreeSet<String>,
}

/// One application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Application {
    /// Its name in the configuration (`[applications.<name>]`).
    pub name: String,
    /// Patterns of the queues it may name as `reply_to`.
    reply_to: Vec<String>,
    /// The namespace of its orders' stored ids.
    namespace: Uuid,
}

/// Why a message is refused as no application's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unknown {
    #[error("no user_id: with applications configured, a message must carry its sender's user_id")]
    NoUser,
    #[error("user_id {0:?} is no configured application's")]
    User(String),
}

impl Applications {
    /// The applications of the configuration, and sas's own broker users
    /// (whose republished copies carry their original's sender).
    pub fn new(specs: &BTreeMap<String, ApplicationSpec>, own_users: BTreeSet<String>) -> Self {
        let by_user = specs
            .iter()
            .filter_map(|(name, spec)| {
                let user = spec.user.clone()?;
                Some((user, Application::new(name, &spec.reply_to)))
            })
            .collect();
        Self {
            by_user,
            configured: !specs.is_empty(),
            own_users,
        }
    }

    /// Who sent a message with this `user_id` carrying `carried` in
    /// `x-sas-user-id`: the carried sender on a copy sas's own user
    /// republished, else the `user_id` (a stranger's header is ignored).
    pub fn sender<'a>(
        &self,
        user_id: Option<&'a str>,
        carried: Option<&'a str>,
    ) -> Option<&'a str> {
        match (user_id, carried) {
            (Some(user), Some(original)) if self.own_users.contains(user) => Some(original),
            _ => user_id,
        }
    }

    /// [`Applications::identify`] of the sender of a message with this
    /// `user_id` and `x-sas-user-id` ([`Applications::sender`]).
    pub fn identify_sender(
        &self,
        user_id: Option<&str>,
        carried: Option<&str>,
    ) -> Result<Option<&Application>, Unknown> {
        self.identify(self.sender(user_id, carried))
    }

    /// Whether any application is configured.
    pub fn configured(&self) -> bool {
        self.configured
    }

    /// The application that sent a message with this `user_id`: `None`
    /// when no application is configured (anyone may send), else the
    /// application or why there is none.
    pub fn identify(&self, user_id: Option<&str>) -> Result<Option<&Application>, Unknown> {
        if !self.configured {
            return Ok(None);
        }
        let user = user_id.ok_or(Unknown::NoUser)?;
        self.by_user
            .get(user)
            .map(Some)
            .ok_or_else(|| Unknown::User(sas_protocol::limits::truncate_bytes(user, 64).to_owned()))
    }
}

impl Application {
    /// The application `name` with its reply-queue patterns.
    pub fn new(name: &str, reply_to: &[String]) -> Self {
        Self {
            name: name.to_owned(),
            reply_to: reply_to.to_vec(),
            namespace: Uuid::new_v5(
                &Uuid::NAMESPACE_URL,
                format!("urn:sas:application:{name}").as_bytes(),
            ),
        }
    }

    /// Whether it may name `queue` as where its events go.
    pub fn may_reply_to(&self, queue: &str) -> bool {
        self.reply_to.iter().any(|p| matches(p, queue))
    }

    /// The stored id of its order `given`.
    pub fn order_id(&self, given: Uuid) -> Uuid {
        Uuid::new_v5(&self.namespace, given.as_bytes())
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of
/// characters (none included) and everything else only itself.
pub fn matches(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole text.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(user: &str, reply_to: &[&str]) -> ApplicationSpec {
        ApplicationSpec {
            user: Some(user.to_owned()),
            reply_to: reply_to.iter().map(|s| (*s).to_owned()).collect(),
            tokens: Vec::new(),
        }
    }

    #[test]
    fn patterns_match_with_stars_and_nothing_else() {
        for (pattern, text, expected) in [
            ("shop.*", "shop.status", true),
            ("shop.*", "shop.", true),
            ("shop.*", "shop", false),
            ("shop.*", "shopx.status", false),
            ("shop.status", "shop.status", true),
            ("shop.status", "shop.statusx", false),
            ("*", "anything", true),
            ("*.status", "a.b.status", true),
            ("a*b*c", "abc", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "acb", false),
            ("a*a", "a", false),
            ("shop.?", "shop.x", false),
        ] {
            assert_eq!(matches(pattern, text), expected, "{pattern} ~ {text}");
        }
    }

    #[test]
    fn a_message_is_an_applications_by_its_user_once_any_is_configured() {
        let none = Applications::new(&BTreeMap::new(), BTreeSet::new());
        assert_eq!(none.identify(None), Ok(None));
        assert_eq!(none.identify(Some("x")), Ok(None));

        let apps = Applications::new(
            &BTreeMap::from([
                ("shop".to_owned(), spec("shop-user", &["shop.*"])),
                (
                    "billing".to_owned(),
                    spec("billing-user", &["billing.status"]),
                ),
            ]),
            BTreeSet::from(["sas".to_owned()]),
        );
        assert!(apps.configured());
        assert_eq!(apps.identify(None), Err(Unknown::NoUser));
        assert_eq!(
            apps.identify(Some("guest")),
            Err(Unknown::User("guest".into()))
        );
        let shop = apps.identify(Some("shop-user")).unwrap().unwrap();
        assert_eq!(shop.name, "shop");
        assert!(shop.may_reply_to("shop.status"));
        assert!(!shop.may_reply_to("billing.status"));
        let billing = apps.identify(Some("billing-user")).unwrap().unwrap();
        // The same id from two applications is two orders, each stable.
        let given = Uuid::new_v4();
        assert_ne!(shop.order_id(given), billing.order_id(given));
        assert_ne!(shop.order_id(given), given);
        assert_eq!(shop.order_id(given), shop.order_id(given));
    }

    #[test]
    fn a_copy_says_who_sent_its_original_only_when_sas_itself_republished_it() {
        let apps = Applications::new(
            &BTreeMap::from([
                ("shop".to_owned(), spec("shop-user", &["shop.*"])),
                ("billing".to_owned(), spec("billing-user", &["b.*"])),
            ]),
            BTreeSet::from(["sas".to_owned()]),
        );
        // sas's retry or replay of the shop's message is the shop's.
        assert_eq!(
            apps.sender(Some("sas"), Some("shop-user")),
            Some("shop-user")
        );
        let shop = apps.identify_sender(Some("sas"), Some("shop-user"));
        assert_eq!(shop.unwrap().unwrap().name, "shop");
        // Anyone else's header is ignored: billing cannot pose as the shop,
        // nor can a message without a user_id.
        let posing = apps.identify_sender(Some("billing-user"), Some("shop-user"));
        assert_eq!(posing.unwrap().unwrap().name, "billing");
        assert_eq!(
            apps.identify_sender(None, Some("shop-user")),
            Err(Unknown::NoUser)
        );
        // sas's own message without the header is sas's (no application).
        assert_eq!(
            apps.identify_sender(Some("sas"), None),
            Err(Unknown::User("sas".into()))
        );
    }
}
