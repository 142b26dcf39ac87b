//! A standby host element's decision, sans-IO: when to claim the cluster's `active` key and
//! take over. Inputs: what each element says when observed (`Observe` → `Observed`: the epoch it
//! follows, its holder, how long the holder has been gone) and what the coordinator (etcd) says
//! of the key. Output: wait, claim the key (if nobody holds it, or from a holder the elements
//! lost, by compare on its revision), or take over (we hold it).
//!
//! The rule (see ARCHITECTURE.md, "Failover"): act only when at least `start_minimum` elements
//! say the host element they follow has been gone for `takeover_after_ms` — the elements decide
//! whether, the coordinator only which standby. A claim younger than `claim_grace_ms` is left to
//! its holder (it needs that long to take the elements). Safety does not rest on this rule: a
//! takeover at the wrong time is fenced by the elements' epochs and read leases; the rule keeps
//! host elements from taking the elements from each other without need.

use proto::{Epoch, HostId};

use crate::host::start_minimum_of;
use crate::Time;

/// What one element said, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    pub epoch: Epoch,
    pub holder: HostId,
    pub owner_absent_ms: u64,
    pub at: Time,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StandbyConfig {
    pub me: HostId,
    pub elements: usize,
    pub quorum: usize,
    pub takeover_after_ms: u64,
    /// An observation older than this is not counted.
    pub fresh_ms: u64,
    pub claim_grace_ms: u64,
}

/// The coordinator's `active` key as last read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    /// The coordinator did not answer: do nothing.
    Unknown,
    Absent,
    Held {
        holder: HostId,
        revision: i64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Wait,
    /// Take the key: `expected` None if nobody holds it, else its revision as read.
    Claim {
        expected: Option<i64>,
    },
    /// We hold the key and the elements lost their host element.
    TakeOver,
}

#[derive(Debug)]
pub struct StandbyCore {
    config: StandbyConfig,
    observations: Vec<Option<Observation>>,
    /// The key's revision as last read, and when it was first seen.
    key_first_seen: Option<(i64, Time)>,
}

impl StandbyConfig {
    /// The default rule (`limits`) for `me` among `elements` with write quorum `quorum`.
    pub fn new(me: HostId, elements: usize, quorum: usize, takeover_after_ms: u64) -> StandbyConfig {
        StandbyConfig {
            me,
            elements,
            quorum,
            takeover_after_ms,
            fresh_ms: crate::limits::OBSERVATION_FRESH_MS,
            claim_grace_ms: crate::limits::CLAIM_GRACE_MS,
        }
    }
}

impl StandbyCore {
    pub fn new(config: StandbyConfig) -> StandbyCore {
        assert!(config.elements > 0 && config.quorum >= 1 && config.quorum <= config.elements);
        StandbyCore { observations: vec![None; config.elements], config, key_first_seen: None }
    }

    /// What element `element` said (None: it could not be asked).
    pub fn observe(&mut self, element: usize, observation: Option<Observation>) {
        self.observations[element] = observation;
    }

    fn fresh(&self, now: Time) -> impl Iterator<Item = &Observation> {
        let fresh_us = self.config.fresh_ms * 1000;
        self.observations.iter().flatten().filter(move |o| now.micros_since(o.at) < fresh_us)
    }

    /// How many elements say the host element they follow is gone (or follow none, or follow
    /// us while we are a standby: we serve nothing).
    pub fn absent_count(&self, now: Time) -> usize {
        let me = self.config.me;
        let after = self.config.takeover_after_ms;
        self.fresh(now).filter(|o| o.epoch == Epoch(0) || o.owner_absent_ms >= after || o.holder == me).count()
    }

    /// The newest epoch any element follows now (a takeover takes one above it).
    pub fn newest_epoch(&self, now: Time) -> Epoch {
        self.fresh(now).map(|o| o.epoch).max().unwrap_or(Epoch(0))
    }

    /// Per element, its last observation if fresh.
    pub fn observations(&self, now: Time) -> Vec<Option<Observation>> {
        let fresh_us = self.config.fresh_ms * 1000;
        self.observations.iter().map(|o| o.filter(|o| now.micros_since(o.at) < fresh_us)).collect()
    }

    /// The holder most elements following the newest epoch name (not HostId(0)).
    pub fn followed_holder(&self, now: Time) -> Option<HostId> {
        let newest = self.newest_epoch(now);
        let mut counts: Vec<(HostId, usize)> = Vec::new();
        for o in self.fresh(now).filter(|o| o.epoch == newest && o.holder != HostId(0)) {
            match counts.iter_mut().find(|(h, _)| *h == o.holder) {
                Some((_, n)) => *n += 1,
                None => counts.push((o.holder, 1)),
            }
        }
        counts.into_iter().max_by_key(|&(h, n)| (n, h.0)).map(|(h, _)| h)
    }

    /// The decision at `now`, given the key as just read. Call it every observation round.
    pub fn decide(&mut self, now: Time, key: Key) -> Decision {
        if let Key::Held { revision, .. } = key {
            if self.key_first_seen.is_none_or(|(r, _)| r != revision) {
                self.key_first_seen = Some((revision, now));
            }
        }
        let needed = start_minimum_of(self.config.elements, self.config.quorum);
        if self.absent_count(now) < needed {
            return Decision::Wait;
        }
        match key {
            Key::Unknown => Decision::Wait,
            Key::Absent => Decision::Claim { expected: None },
            Key::Held { holder, .. } if holder == self.config.me => Decision::TakeOver,
            Key::Held { revision, .. } => {
                let (_, first) = self.key_first_seen.expect("recorded above");
                if now.micros_since(first) < self.config.claim_grace_ms * 1000 {
                    Decision::Wait
                } else {
                    Decision::Claim { expected: Some(revision) }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: HostId = HostId(7);
    const OLD: HostId = HostId(3);

    fn core() -> StandbyCore {
        StandbyCore::new(StandbyConfig {
            me: ME,
            elements: 3,
            quorum: 2,
            takeover_after_ms: 300,
            fresh_ms: 1000,
            claim_grace_ms: 1500,
        })
    }

    fn saw(c: &mut StandbyCore, at_ms: u64, absent: [u64; 3]) {
        for (i, a) in absent.into_iter().enumerate() {
            let o = Observation { epoch: Epoch(4), holder: OLD, owner_absent_ms: a, at: Time(at_ms * 1000) };
            c.observe(i, Some(o));
        }
    }

    #[test]
    fn waits_while_the_elements_hear_the_active_one_whatever_the_key_says() {
        let mut c = core();
        saw(&mut c, 0, [0, 0, 900]);
        for key in [Key::Absent, Key::Unknown, Key::Held { holder: ME, revision: 5 }] {
            assert_eq!(c.decide(Time(0), key), Decision::Wait, "{key:?}: one element alone is not enough");
        }
    }

    #[test]
    fn claims_from_a_holder_the_elements_lost_and_takes_over_once_it_holds_the_key() {
        let mut c = core();
        saw(&mut c, 0, [0, 0, 0]);
        assert_eq!(c.decide(Time(0), Key::Held { holder: OLD, revision: 9 }), Decision::Wait);
        saw(&mut c, 2000, [300, 310, 0]);
        let now = Time(2_000_000);
        assert_eq!(c.decide(now, Key::Held { holder: OLD, revision: 9 }), Decision::Claim { expected: Some(9) });
        assert_eq!(c.decide(now, Key::Absent), Decision::Claim { expected: None });
        assert_eq!(c.decide(now, Key::Held { holder: ME, revision: 10 }), Decision::TakeOver);
        assert_eq!(c.decide(now, Key::Unknown), Decision::Wait, "no coordinator, no takeover");
        assert_eq!(c.newest_epoch(now), Epoch(4));
        assert_eq!(c.followed_holder(now), Some(OLD));
    }

    #[test]
    fn a_fresh_claim_is_left_to_its_holder_and_stale_observations_do_not_count() {
        let mut c = core();
        saw(&mut c, 0, [400, 400, 400]);
        let other = HostId(11);
        assert_eq!(c.decide(Time(0), Key::Held { holder: other, revision: 12 }), Decision::Wait);
        assert_eq!(c.decide(Time(900_000), Key::Held { holder: other, revision: 12 }), Decision::Wait);
        // The observations are now too old to count.
        assert_eq!(c.decide(Time(1_600_000), Key::Held { holder: other, revision: 12 }), Decision::Wait);
        saw(&mut c, 1600, [400, 400, 0]);
        assert_eq!(
            c.decide(Time(1_600_000), Key::Held { holder: other, revision: 12 }),
            Decision::Claim { expected: Some(12) }
        );
    }
}
