//! The host elements' coordination service: etcd (v3 API, through `etcd-client`).
//!
//! Host elements of one cluster share two keys under `/starfish/<cluster>/`:
//!
//! - `active`: the host element that should serve (its identity and admin address, JSON),
//!   attached to that host element's lease (TTL `LEASE_TTL_S`, kept alive every third of it).
//!   Created only if absent, or taken over from a holder the elements say is gone (compare on
//!   the key's modification revision): one winner.
//! - `epoch`: the newest epoch a host element took, raised by compare-and-swap.
//!
//! The lease only elects which standby may act. Whether to act — and safety — come from the
//! elements: a standby takes over only once they say the host element they follow is gone, and
//! an element welcomes a new epoch only after the read lease it promised the old one ran out.
//! So a host element cut off from etcd but not from the elements is never deposed by its lapsed
//! lease alone, and a standby cut off from etcd never takes over.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};

/// etcd's lease TTL floor in practice: the key goes 2.4–2.5 s after the last keep-alive.
pub const LEASE_TTL_S: i64 = 2;
/// Every etcd request gives up after this: a dead etcd must not hold anything up.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);

/// What the `active` key says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub host_id: u64,
    pub admin: String,
}

/// The `active` key as read: its holder and modification revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActiveKey {
    pub holder: Holder,
    pub mod_revision: i64,
}

pub struct Coordinator {
    client: Client,
    active_key: String,
    epoch_key: String,
    /// Our lease and when it was last granted or renewed.
    lease: Option<(i64, std::time::Instant)>,
}

type Result<T> = std::result::Result<T, String>;

fn failed(what: &str, error: impl std::fmt::Display) -> String {
    format!("etcd: {what}: {error}")
}

impl Coordinator {
    /// Connect to the etcd at `endpoint` (`http://HOST:PORT`, or `HOST:PORT`).
    pub async fn connect(endpoint: &str, cluster: &str) -> Result<Coordinator> {
        let options = ConnectOptions::new().with_timeout(REQUEST_TIMEOUT).with_connect_timeout(REQUEST_TIMEOUT);
        let client = tokio::time::timeout(REQUEST_TIMEOUT * 2, Client::connect([endpoint], Some(options)))
            .await
            .map_err(|_| failed("connect", format!("{endpoint} did not answer")))?
            .map_err(|e| failed("connect", e))?;
        Ok(Coordinator {
            client,
            active_key: format!("/starfish/{cluster}/active"),
            epoch_key: format!("/starfish/{cluster}/epoch"),
            lease: None,
        })
    }

    /// Our lease: the one kept alive lately, else a new one (a standby's lease lapses unused).
    async fn lease(&mut self) -> Result<i64> {
        if let Some((id, renewed)) = self.lease {
            if renewed.elapsed() < Duration::from_millis(LEASE_TTL_S as u64 * 1000 / 2) {
                return Ok(id);
            }
        }
        let granted = self.client.lease_grant(LEASE_TTL_S, None).await.map_err(|e| failed("lease grant", e))?;
        self.lease = Some((granted.id(), std::time::Instant::now()));
        Ok(granted.id())
    }

    /// Renew our lease once; a lapsed one is forgotten (the next campaign takes a new one).
    pub async fn keep_alive(&mut self) -> Result<()> {
        let Some((id, _)) = self.lease else { return Ok(()) };
        let (mut keeper, mut stream) = self.client.lease_keep_alive(id).await.map_err(|e| failed("keep-alive", e))?;
        keeper.keep_alive().await.map_err(|e| failed("keep-alive", e))?;
        match stream.message().await {
            Ok(Some(answer)) if answer.ttl() > 0 => {
                self.lease = Some((id, std::time::Instant::now()));
                Ok(())
            }
            Ok(_) => {
                self.lease = None;
                Err("etcd: our lease lapsed".into())
            }
            Err(e) => Err(failed("keep-alive", e)),
        }
    }

    /// Who holds the `active` key, if anyone.
    pub async fn active(&mut self) -> Result<Option<ActiveKey>> {
        let answer = self.client.get(self.active_key.as_str(), None).await.map_err(|e| failed("get", e))?;
        let Some(kv) = answer.kvs().first() else { return Ok(None) };
        let holder: Holder = serde_json::from_slice(kv.value()).map_err(|e| failed("active key", e))?;
        Ok(Some(ActiveKey { holder, mod_revision: kv.mod_revision() }))
    }

    /// Take the `active` key for `me` if nobody holds it (`expected` None) or if it is still
    /// exactly what we read (`expected`: its modification revision). True if we hold it now.
    pub async fn claim(&mut self, me: &Holder, expected: Option<i64>) -> Result<bool> {
        let lease = self.lease().await?;
        let compare = match expected {
            None => Compare::create_revision(self.active_key.as_str(), CompareOp::Equal, 0),
            Some(revision) => Compare::mod_revision(self.active_key.as_str(), CompareOp::Equal, revision),
        };
        let value = serde_json::to_vec(me).expect("a holder serialises");
        let put = TxnOp::put(self.active_key.as_str(), value, Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when([compare]).and_then([put]);
        let answer = self.client.txn(txn).await.map_err(|e| failed("claim", e))?;
        Ok(answer.succeeded())
    }

    /// Give the `active` key up (a graceful handover): revoke our lease.
    pub async fn resign(&mut self) -> Result<()> {
        if let Some((id, _)) = self.lease.take() {
            self.client.lease_revoke(id).await.map_err(|e| failed("revoke", e))?;
        }
        Ok(())
    }

    /// Take the next epoch: one above both `floor` (what the elements follow) and the newest
    /// any host element took through etcd, by compare-and-swap.
    pub async fn next_epoch(&mut self, floor: u64) -> Result<u64> {
        for _ in 0..16 {
            let answer = self.client.get(self.epoch_key.as_str(), None).await.map_err(|e| failed("get epoch", e))?;
            let (current, revision) = match answer.kvs().first() {
                Some(kv) => {
                    let text = kv.value_str().map_err(|e| failed("epoch key", e))?;
                    (text.parse::<u64>().map_err(|e| failed("epoch key", e))?, kv.mod_revision())
                }
                None => (0, 0),
            };
            let next = current.max(floor.saturating_sub(1)) + 1;
            let compare = if revision == 0 {
                Compare::create_revision(self.epoch_key.as_str(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(self.epoch_key.as_str(), CompareOp::Equal, revision)
            };
            let txn =
                Txn::new().when([compare]).and_then([TxnOp::put(self.epoch_key.as_str(), next.to_string(), None)]);
            let answer = self.client.txn(txn).await.map_err(|e| failed("raise epoch", e))?;
            if answer.succeeded() {
                return Ok(next);
            }
            // Another host element raised it meanwhile: read again.
        }
        Err("etcd: the epoch key keeps changing under us".into())
    }
}
