//! When to try again what could not be programmed: the Services and the node's state, with one
//! backoff.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::model::Frontend;

/// Doubling from `min` at each failed attempt, up to `max`.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Backoff {
    /// How long to wait after the `attempts`-th failure in a row (counting from 1).
    pub fn after(&self, attempts: u32) -> Duration {
        self.min
            .saturating_mul(1 << attempts.saturating_sub(1).min(16))
            .min(self.max)
    }
}

/// Something that failed `attempts` times in a row, and when to try it again.
#[derive(Clone, Copy, Debug)]
struct Attempts {
    attempts: u32,
    due: Instant,
}

impl Attempts {
    /// One more failure at `at` (the first when `before` is None).
    fn failed(before: Option<Attempts>, at: Instant, backoff: Backoff) -> Attempts {
        let attempts = before.map_or(0, |a| a.attempts) + 1;
        Attempts {
            attempts,
            due: at + backoff.after(attempts),
        }
    }
}

/// A Service that could not be programmed.
#[derive(Debug)]
struct Retry {
    when: Attempts,
    /// The frontends its failed sync covered: a retry covers them again (a removal that failed
    /// is no longer in the desired state).
    frontends: BTreeSet<Frontend>,
}

/// The Services ("namespace/name") that could not be programmed, and the node's state if it
/// could not all be written, each tried again after its own backoff.
#[derive(Debug)]
pub struct Retries {
    backoff: Backoff,
    services: BTreeMap<String, Retry>,
    node: Option<Attempts>,
}

impl Retries {
    pub fn new(backoff: Backoff) -> Retries {
        Retries {
            backoff,
            services: BTreeMap::new(),
            node: None,
        }
    }

    /// Service `owner` failed at `at` on `frontends`; its earlier failed frontends stay
    /// covered.
    pub fn failed(&mut self, owner: &str, frontends: &BTreeSet<Frontend>, at: Instant) {
        let old = self.services.remove(owner);
        let mut covered = frontends.clone();
        let before = old.map(|old| {
            covered.extend(old.frontends);
            old.when
        });
        self.services.insert(
            owner.to_string(),
            Retry {
                when: Attempts::failed(before, at, self.backoff),
                frontends: covered,
            },
        );
    }

    /// Forgets `owner`'s failures; true if it had any.
    pub fn healed(&mut self, owner: &str) -> bool {
        self.services.remove(owner).is_some()
    }

    pub fn contains(&self, owner: &str) -> bool {
        self.services.contains_key(owner)
    }

    /// The frontends `owner`'s failed syncs covered.
    pub fn frontends(&self, owner: &str) -> impl Iterator<Item = &Frontend> + '_ {
        self.services
            .get(owner)
            .into_iter()
            .flat_map(|r| r.frontends.iter())
    }

    pub fn owners(&self) -> impl Iterator<Item = &String> + '_ {
        self.services.keys()
    }

    /// The Services due for another try at `now`.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.services
            .iter()
            .filter(|(_, r)| r.when.due <= now)
            .map(|(o, _)| o.clone())
            .collect()
    }

    /// When the next Service, or the node's state, is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.services
            .values()
            .map(|r| r.when.due)
            .chain(self.node.map(|n| n.due))
            .min()
    }

    /// Writing the node's state failed at `at`.
    pub fn node_failed(&mut self, at: Instant) {
        self.node = Some(Attempts::failed(self.node, at, self.backoff));
    }

    /// Forgets the node's failures; true if it had any.
    pub fn node_healed(&mut self) -> bool {
        self.node.take().is_some()
    }

    pub fn node_failing(&self) -> bool {
        self.node.is_some()
    }

    /// Whether the node's state is due for another try at `now`.
    pub fn node_due(&self, now: Instant) -> bool {
        self.node.is_some_and(|n| now >= n.due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_bound() {
        let b = Backoff {
            min: Duration::from_millis(500),
            max: Duration::from_secs(60),
        };
        assert_eq!(b.after(1), Duration::from_millis(500));
        assert_eq!(b.after(2), Duration::from_secs(1));
        assert_eq!(b.after(4), Duration::from_secs(4));
        assert_eq!(b.after(8), Duration::from_secs(60));
        assert_eq!(b.after(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn a_retry_keeps_covering_the_frontends_of_earlier_failures() {
        let b = Backoff {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
        };
        let fe = |port| {
            Frontend::cluster(
                "10.96.0.1".parse().unwrap(),
                port,
                crate::model::Protocol::Tcp,
            )
        };
        let t = Instant::now();
        let mut r = Retries::new(b);
        r.failed("a/web", &BTreeSet::from([fe(80)]), t);
        r.failed("a/web", &BTreeSet::from([fe(81)]), t);
        assert_eq!(r.frontends("a/web").count(), 2);
        assert_eq!(r.next_due(), Some(t + Duration::from_secs(2)));
        assert!(r.due(t + Duration::from_secs(1)).is_empty());
        assert_eq!(r.due(t + Duration::from_secs(2)), ["a/web"]);
        assert!(r.healed("a/web"));
        assert!(!r.contains("a/web"));
        assert_eq!(r.next_due(), None);
    }

    #[test]
    fn the_node_backs_off_as_a_service_does() {
        let b = Backoff {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
        };
        let t = Instant::now();
        let mut r = Retries::new(b);
        r.node_failed(t);
        r.node_failed(t);
        assert!(r.node_failing());
        assert!(!r.node_due(t + Duration::from_secs(1)));
        assert!(r.node_due(t + Duration::from_secs(2)));
        assert_eq!(r.next_due(), Some(t + Duration::from_secs(2)));
        assert!(r.node_healed());
        assert!(!r.node_healed());
    }
}
