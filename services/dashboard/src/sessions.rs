//! Login sessions of `token` mode, held in memory: the cookie carries a
//! random session id (256 bits from the OS's random source) and nothing else;
//! the identity it stands for stays here until the session expires, its
//! holder logs out or the dashboard restarts.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::identity::Identity;

/// Most sessions held at once; opening one more drops the one that expires
/// first. Only a valid token opens a session, so this bounds memory rather
/// than keeping anyone out.
const MAX_SESSIONS: usize = 4096;

/// The open sessions.
pub struct Sessions {
    /// How long a session lasts from its login.
    ttl: Duration,
    open: Mutex<HashMap<String, Session>>,
}

struct Session {
    identity: Identity,
    expires: Instant,
}

impl Sessions {
    /// No sessions yet; each will last `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// How long a session lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Opens a session for `identity`; returns its id.
    pub fn open(&self, identity: Identity) -> String {
        self.open_at(identity, Instant::now())
    }

    fn open_at(&self, identity: Identity, now: Instant) -> String {
        // UUIDv4 draws from the OS's random source (getrandom): two of them
        // make an id nobody can guess.
        let id = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|_, s| s.expires > now);
        if open.len() >= MAX_SESSIONS
            && let Some(first) = open
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
        {
            open.remove(&first);
        }
        open.insert(
            id.clone(),
            Session {
                identity,
                expires: now + self.ttl,
            },
        );
        id
    }

    /// The identity of an open, unexpired session.
    pub fn get(&self, id: &str) -> Option<Identity> {
        self.get_at(id, Instant::now())
    }

    fn get_at(&self, id: &str, now: Instant) -> Option<Identity> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        match open.get(id) {
            Some(s) if s.expires > now => Some(s.identity.clone()),
            Some(_) => {
                open.remove(id);
                None
            }
            None => None,
        }
    }

    /// Ends a session (logout); an unknown id is ignored.
    pub fn close(&self, id: &str) {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::config::Role;

    fn alice() -> Identity {
        Identity {
            name: "alice".into(),
            role: Role::Operator,
        }
    }

    #[test]
    fn a_session_lasts_its_ttl_and_ends_at_logout() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let id = sessions.open_at(alice(), t0);
        assert_eq!(id.len(), 64);
        assert_eq!(
            sessions.get_at(&id, t0 + Duration::from_secs(59)),
            Some(alice())
        );
        assert_eq!(sessions.get_at(&id, t0 + Duration::from_secs(60)), None);
        let id = sessions.open_at(alice(), t0);
        assert_ne!(sessions.open_at(alice(), t0), id, "fresh ids");
        sessions.close(&id);
        assert_eq!(sessions.get_at(&id, t0), None);
        assert_eq!(sessions.get_at("", t0), None);
    }

    #[test]
    fn the_number_of_sessions_is_bounded() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let first = sessions.open_at(alice(), t0);
        for i in 1..=MAX_SESSIONS {
            sessions.open_at(alice(), t0 + Duration::from_millis(i as u64));
        }
        let open = sessions.open.lock().unwrap().len();
        assert_eq!(open, MAX_SESSIONS);
        assert_eq!(sessions.get_at(&first, t0), None, "the oldest went first");
    }
}
