//! Ack policies: what an element's acknowledgement of a write means before the host element
//! counts it toward the write quorum (SPEC section 2, SMFS's modes).

/// Per element, set in the configuration (`--element NAME=ADDR,ack=POLICY`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AckPolicy {
    /// On stable storage: written and fdatasync'd (the element's `Applied`).
    #[default]
    Durable,
    /// In the element's memory, waiting to be committed (its `Received`): lost if the element
    /// crashes before it commits.
    Received,
    /// A far element that counts once it stored the write (as `durable`; SMFS's name).
    RemoteSync,
    /// A far element that counts once the write is on the wire toward it: handed to the
    /// connection's socket (over TCP: the kernel's send buffer). Lost if the element, or the
    /// link and the local site, fail before it arrives and is stored.
    NetworkSync,
    /// Never counts toward the quorum: mirrored in the background, as fast as it keeps up
    /// (the write queue still holds each write until the element has stored it).
    LocalSync,
}

impl AckPolicy {
    pub const ALL: [AckPolicy; 5] =
        [AckPolicy::Durable, AckPolicy::Received, AckPolicy::RemoteSync, AckPolicy::NetworkSync, AckPolicy::LocalSync];

    pub fn as_str(self) -> &'static str {
        match self {
            AckPolicy::Durable => "durable",
            AckPolicy::Received => "received",
            AckPolicy::RemoteSync => "remote-sync",
            AckPolicy::NetworkSync => "network-sync",
            AckPolicy::LocalSync => "local-sync",
        }
    }

    pub fn parse(text: &str) -> Result<AckPolicy, String> {
        AckPolicy::ALL.into_iter().find(|p| p.as_str() == text).ok_or_else(|| {
            let names: Vec<&str> = AckPolicy::ALL.iter().map(|p| p.as_str()).collect();
            format!("unknown ack policy {text:?}: use one of {}", names.join(", "))
        })
    }

    /// Whether its acknowledgements count toward the write quorum at all.
    pub fn counts_toward_quorum(self) -> bool {
        self != AckPolicy::LocalSync
    }

    /// Whether it counts only once the write is stored (its `Applied`).
    pub fn needs_durable(self) -> bool {
        matches!(self, AckPolicy::Durable | AckPolicy::RemoteSync)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_explained() {
        for p in AckPolicy::ALL {
            assert_eq!(AckPolicy::parse(p.as_str()), Ok(p));
        }
        let err = AckPolicy::parse("fast").unwrap_err();
        assert!(err.contains("network-sync") && err.contains("\"fast\""), "{err}");
        assert!(!AckPolicy::LocalSync.counts_toward_quorum() && AckPolicy::NetworkSync.counts_toward_quorum());
    }
}
