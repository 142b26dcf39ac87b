//! The element's rules, each as a short script of inputs and the actions they must produce.

use bytes::Bytes;
use proto::{ElementMessage, Epoch, HostId, HostMessage, Op, Record, Sequence, VolumeId, VolumeSpec};

use super::*;

const MB: u64 = 1024 * 1024;

/// An element core with storage that does what it is told, and a clock.
struct Harness {
    core: ElementCore,
    now: Time,
    /// The storage job in flight, as the core asked for it.
    storage: Option<StorageJob>,
    /// What the harness's storage holds per local volume: (applied, epoch).
    held: Vec<(Sequence, Epoch)>,
    /// Actions drained by a helper, handed out by the next `actions`.
    pending: Vec<ElementAction>,
}

/// The host element the harness's sessions speak for (and the holder of its initial epoch).
const HOST: HostId = HostId(1);

fn spec(name: &str) -> VolumeSpec {
    VolumeSpec { name: name.into(), size_bytes: 64 * MB, clone_of: None, at_least: false }
}

fn record(volume: u32, epoch: u64, sequence: u64) -> Record {
    Record {
        volume: VolumeId(volume),
        epoch: Epoch(epoch),
        sequence: Sequence(sequence),
        op: Op::write(0, Bytes::from(vec![sequence as u8; 4096])),
    }
}

fn applied(volume: u32, sequence: u64) -> ElementMessage {
    ElementMessage::Applied { volume: VolumeId(volume), sequence: Sequence(sequence) }
}

impl Harness {
    fn new(epoch: u64, volumes: &[(&str, u64, u64)]) -> Harness {
        Harness::with_config(ElementConfig::default(), epoch, volumes)
    }

    fn with_config(config: ElementConfig, epoch: u64, volumes: &[(&str, u64, u64)]) -> Harness {
        let infos = volumes
            .iter()
            .map(|&(name, applied, applied_epoch)| {
                let info = VolumeInfo {
                    applied: Sequence(applied),
                    applied_epoch: Epoch(applied_epoch),
                    copying: false,
                    repair: false,
                };
                (spec(name), info)
            })
            .collect();
        let held = volumes.iter().map(|&(_, a, e)| (Sequence(a), Epoch(e))).collect();
        let mut core = ElementCore::new(config, Epoch(epoch), HOST, infos);
        // Started long enough ago that a lease promised before it started has run out.
        core.handle_timeout(Time(0));
        Harness { core, now: Time(1_000_000), storage: None, held, pending: Vec::new() }
    }

    /// Every action since the last call, storage jobs remembered, logs left out.
    fn actions(&mut self) -> Vec<ElementAction> {
        self.core.assert_invariants();
        let mut out = std::mem::take(&mut self.pending);
        while let Some(action) = self.core.poll_action() {
            match action {
                ElementAction::Log { .. } => {}
                ElementAction::Storage(job) => {
                    assert!(self.storage.is_none(), "one storage job at a time");
                    self.storage = Some(job.clone());
                    out.push(ElementAction::Storage(job));
                }
                other => out.push(other),
            }
        }
        out
    }

    /// Messages sent to sessions since the last call (other actions dropped).
    fn sent(&mut self) -> Vec<(u64, ElementMessage)> {
        self.actions()
            .into_iter()
            .filter_map(|a| match a {
                ElementAction::Send { session, message } => Some((session.0, message)),
                _ => None,
            })
            .collect()
    }

    /// A session says hello; volumes are found by name (a new name gets the next number).
    fn hello(&mut self, session: u64, epoch: u64, names: &[&str]) {
        self.hello_from(session, epoch, HOST, names)
    }

    /// A peer element's hello (a copy or replay source's session), at the host element's epoch.
    fn peer_hello(&mut self, session: u64, epoch: u64, names: &[&str]) {
        self.hello_as(session, epoch, HOST, SessionRole::Element, names)
    }

    /// A hello from a given host element; one refused at once leaves its actions pending.
    fn hello_from(&mut self, session: u64, epoch: u64, host: HostId, names: &[&str]) {
        self.hello_as(session, epoch, host, SessionRole::Host, names)
    }

    fn hello_as(&mut self, session: u64, epoch: u64, host: HostId, role: SessionRole, names: &[&str]) {
        self.core.handle_session_opened(self.now, SessionId(session), role);
        let specs: Vec<VolumeSpec> = names.iter().map(|n| spec(n)).collect();
        self.core.handle_host_message(
            self.now,
            SessionId(session),
            HostMessage::Hello {
                epoch: Epoch(epoch),
                host,
                volumes: specs.clone(),
                admin: String::new(),
                receipt_acks: false,
            },
        );
        let actions = self.actions();
        let ensure = ElementAction::EnsureVolumes { session: SessionId(session), specs: specs.clone() };
        if !actions.contains(&ensure) {
            self.pending = actions;
            return;
        }
        let ensured = names
            .iter()
            .map(|n| {
                let index = self.core.volumes.iter().position(|v| v.spec.name == *n).unwrap_or_else(|| {
                    self.held.push((Sequence::ZERO, Epoch(0)));
                    self.held.len() - 1
                });
                let (applied, applied_epoch) = self.held[index];
                (LocalVolume(index as u32), VolumeInfo { applied, applied_epoch, copying: false, repair: false })
            })
            .collect();
        self.core.handle_volumes_ensured(self.now, SessionId(session), Ok(ensured));
    }

    fn host(&mut self, session: u64, message: HostMessage) {
        self.core.handle_host_message(self.now, SessionId(session), message);
    }

    /// Storage finishes its job successfully.
    fn storage_done(&mut self) {
        self.actions();
        let job = self.storage.take().expect("a storage job in flight");
        let done = match job {
            StorageJob::AdoptEpoch(..) => StorageDone::AdoptEpoch(Ok(())),
            StorageJob::Commit(records) => {
                let mut applied: Vec<(LocalVolume, Sequence, Epoch)> = Vec::new();
                for (volume, record) in records {
                    let held = &mut self.held[volume.0 as usize];
                    assert_eq!(record.sequence, held.0.next(), "the core sends storage records in order");
                    *held = (record.sequence, record.epoch);
                    applied.retain(|(v, _, _)| *v != volume);
                    applied.push((volume, record.sequence, record.epoch));
                }
                StorageDone::Commit(Ok(CommitDone { applied, rejected: Vec::new() }))
            }
            StorageJob::RemoveVolumes(_) => StorageDone::RemoveVolumes(Ok(())),
            StorageJob::ResizeVolumes(_) => StorageDone::ResizeVolumes(Ok(())),
        };
        self.core.handle_storage_done(self.now, done);
    }

    /// Run storage until it idles.
    fn settle(&mut self) -> Vec<(u64, ElementMessage)> {
        let mut sent = self.sent();
        while self.storage.is_some() {
            self.storage_done();
            sent.extend(self.sent());
        }
        sent
    }

    fn advance_ms(&mut self, ms: u64) {
        self.now = self.now.plus_ms(ms);
        self.core.handle_timeout(self.now);
    }
}

fn welcome(epoch: u64, volumes: &[(u64, u64)]) -> ElementMessage {
    ElementMessage::Welcome {
        epoch: Epoch(epoch),
        element_id: 0,
        volumes: volumes
            .iter()
            .map(|&(a, e)| proto::VolumeState {
                applied_sequence: Sequence(a),
                applied_epoch: Epoch(e),
                copying: false,
                repair: false,
                size_bytes: 64 * MB,
            })
            .collect(),
    }
}

fn is_fault(message: &ElementMessage, containing: &str) -> bool {
    matches!(message, ElementMessage::Fault { reason } if reason.contains(containing))
}

// ----- epochs ---------------------------------------------------------------------------------

#[test]
fn hello_epochs_table() {
    // (element epoch, hello epoch, from the holder of the element's epoch, adopts durably,
    // welcomed, refusal text)
    let other = HostId(2);
    let table = [
        (5, 5, HOST, false, true, ""),
        (5, 7, HOST, true, true, ""),
        (5, 7, other, true, true, ""),
        (5, 4, HOST, false, false, "stale epoch"),
        (5, 4, other, false, false, "stale epoch"),
        // Two host elements never share an epoch.
        (5, 5, other, false, false, "belongs to another host element"),
        (0, 1, HOST, true, true, ""),
    ];
    for (ours, theirs, host, adopts, welcomed, refusal) in table {
        let mut h = Harness::new(ours, &[("a", 0, 0)]);
        h.hello_from(1, theirs, host, &["a"]);
        let actions = h.actions();
        let adopting = actions.contains(&ElementAction::Storage(StorageJob::AdoptEpoch(Epoch(theirs), host)));
        assert_eq!(adopting, adopts, "{ours} ← {theirs}: {actions:?}");
        // The welcome waits for a new epoch to be durable.
        assert!(
            !adopts
                || !actions
                    .iter()
                    .any(|a| matches!(a, ElementAction::Send { message: ElementMessage::Welcome { .. }, .. }))
        );
        let sent: Vec<_> = actions
            .into_iter()
            .filter_map(|a| match a {
                ElementAction::Send { message, .. } => Some(message),
                _ => None,
            })
            .chain(h.settle().into_iter().map(|(_, m)| m))
            .collect();
        if welcomed {
            assert_eq!(sent, vec![welcome(ours, &[(0, 0)])], "{ours} ← {theirs}");
            assert_eq!(h.core.epoch(), Epoch(ours.max(theirs)));
            assert_eq!(h.core.holder, host);
        } else {
            // The refusal names the epoch to exceed, and nothing was created for the hello.
            assert!(
                matches!(&sent[..], [ElementMessage::Refused { reason, epoch: Some(e), .. }]
                    if reason.contains(refusal) && *e == Epoch(ours)),
                "{sent:?}"
            );
            assert_eq!(h.core.epoch(), Epoch(ours));
            assert_eq!(h.core.holder, HOST);
        }
    }
}

#[test]
fn hello_is_answered_after_the_records_queued_before_it() {
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 5, 1)));
    h.host(1, HostMessage::Apply(record(0, 5, 2)));
    h.hello(2, 6, &["a"]);
    // Record 1 is being committed, 2 waits, then the hello: the welcome reports 2.
    let sent = h.settle();
    let welcome_at = sent.iter().position(|(s, _)| *s == 2).expect("session 2 welcomed");
    assert_eq!(sent[welcome_at].1, welcome(5, &[(2, 5)]), "{sent:?}");
    assert!(sent[..welcome_at].contains(&(1, applied(0, 2))), "{sent:?}");
}

#[test]
fn records_of_a_superseded_session_are_fenced() {
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 5, 1)));
    h.hello(2, 6, &["a"]);
    h.host(1, HostMessage::Apply(record(0, 5, 2))); // After the newer hello: fenced.
    let sent = h.settle();
    assert!(sent.contains(&(1, applied(0, 1))), "{sent:?}");
    assert!(sent.iter().any(|(s, m)| *s == 1 && is_fault(m, "fenced")), "{sent:?}");
    assert!(!sent.contains(&(1, applied(0, 2))), "{sent:?}");
    assert_eq!(h.core.applied(LocalVolume(0)), Sequence(1));
}

// ----- records --------------------------------------------------------------------------------

#[test]
fn record_rules_table() {
    // Volume applied at 3 (epoch 5); (record epoch, sequence) → outcome.
    enum Outcome {
        Commit,
        Duplicate,
        Fault(&'static str),
    }
    let table = [
        (5, 4, Outcome::Commit),
        (6, 4, Outcome::Commit),
        (5, 3, Outcome::Duplicate),
        (5, 1, Outcome::Duplicate),
        (5, 5, Outcome::Fault("gap")),
        (4, 4, Outcome::Fault("older than the volume's epoch")),
        // The newest record's epoch is known: another one at its sequence is another history.
        (6, 3, Outcome::Fault("two histories")),
    ];
    for (epoch, sequence, outcome) in table {
        let mut h = Harness::new(6, &[("a", 3, 5)]);
        h.hello(1, 6, &["a"]);
        h.settle();
        h.host(1, HostMessage::Apply(record(0, epoch, sequence)));
        let actions = h.actions();
        let committed = actions.iter().any(|a| matches!(a, ElementAction::Storage(StorageJob::Commit(_))));
        let mut sent: Vec<(u64, ElementMessage)> = actions
            .into_iter()
            .filter_map(|a| match a {
                ElementAction::Send { session, message } => Some((session.0, message)),
                _ => None,
            })
            .collect();
        sent.extend(h.settle());
        match outcome {
            Outcome::Commit => {
                assert!(committed);
                assert_eq!(sent, vec![(1, applied(0, sequence))], "({epoch}, {sequence})");
            }
            Outcome::Duplicate => {
                assert!(!committed);
                assert_eq!(sent, vec![(1, applied(0, 3))], "({epoch}, {sequence})");
            }
            Outcome::Fault(text) => {
                assert!(!committed);
                assert!(matches!(&sent[..], [(1, m)] if is_fault(m, text)), "({epoch}, {sequence}): {sent:?}");
            }
        }
    }
}

#[test]
fn a_record_sent_again_must_be_the_same_record() {
    let mut h = Harness::new(6, &[("a", 3, 6)]);
    h.hello(1, 6, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 6, 4)));
    assert_eq!(h.settle(), vec![(1, applied(0, 4))]);
    // The same record again: a duplicate, acknowledged.
    h.host(1, HostMessage::Apply(record(0, 6, 4)));
    assert_eq!(h.settle(), vec![(1, applied(0, 4))]);
    // Same sequence and epoch, other content: refused, not acknowledged.
    let mut other = record(0, 6, 4);
    other.op = Op::write(0, Bytes::from(vec![0xee; 4096]));
    h.host(1, HostMessage::Apply(other));
    let sent = h.settle();
    assert!(matches!(&sent[..], [(1, m)] if is_fault(m, "two histories")), "{sent:?}");
}

#[test]
fn a_damaged_volume_faults_its_sessions_and_asks_for_repair() {
    let mut h = Harness::new(6, &[("a", 3, 6)]);
    h.hello(1, 6, &["a"]);
    h.settle();
    h.core.handle_volume_damaged(h.now, LocalVolume(0));
    let sent = h.settle();
    assert!(matches!(&sent[..], [(1, m)] if is_fault(m, "fails its checksum")), "{sent:?}");
    // The next session hears that the volume needs repair, at its real position.
    h.hello(2, 6, &["a"]);
    let sent = h.settle();
    let want = proto::VolumeState {
        applied_sequence: Sequence(3),
        applied_epoch: Epoch(6),
        copying: false,
        repair: true,
        size_bytes: 64 * MB,
    };
    assert!(matches!(&sent[..], [(2, ElementMessage::Welcome { volumes, .. })] if volumes == &vec![want]), "{sent:?}");
}

#[test]
fn applied_is_sent_only_when_storage_reports_the_commit_done() {
    let mut h = Harness::new(1, &[("a", 0, 0), ("b", 0, 0)]);
    h.hello(1, 1, &["a", "b"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    h.host(1, HostMessage::Apply(record(0, 1, 2)));
    h.host(1, HostMessage::Apply(record(1, 1, 1)));
    // The first record went to storage alone; the other two wait for it.
    assert_eq!(h.sent(), vec![]);
    assert!(matches!(&h.storage, Some(StorageJob::Commit(batch)) if batch.len() == 1));
    h.storage_done();
    assert_eq!(h.sent(), vec![(1, applied(0, 1))]);
    // The next group commit takes both waiting records; one cumulative ack per volume.
    assert!(matches!(&h.storage, Some(StorageJob::Commit(batch)) if batch.len() == 2));
    h.storage_done();
    assert_eq!(h.sent(), vec![(1, applied(0, 2)), (1, applied(1, 1))]);
}

#[test]
fn a_failed_commit_faults_its_sessions_and_storage_takes_no_more() {
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    h.host(1, HostMessage::Apply(record(0, 1, 2)));
    h.actions();
    h.storage = None;
    h.core.handle_storage_done(h.now, StorageDone::Commit(Err("EIO".into())));
    let sent = h.settle();
    assert!(sent.iter().all(|(_, m)| is_fault(m, "commit failed: EIO")), "{sent:?}");
    assert!(!sent.is_empty());
    assert_eq!(h.core.applied(LocalVolume(0)), Sequence::ZERO);
}

#[test]
fn protocol_errors_refuse_the_session() {
    let table: [(&str, Vec<HostMessage>); 3] = [
        ("before hello", vec![HostMessage::Ping { nonce: 1 }]),
        ("unknown volume", vec![HostMessage::Apply(record(7, 1, 1))]),
        (
            "second hello",
            vec![HostMessage::Hello {
                epoch: Epoch(1),
                host: HOST,
                volumes: vec![],
                admin: String::new(),
                receipt_acks: false,
            }],
        ),
    ];
    for (text, messages) in table {
        let mut h = Harness::new(1, &[("a", 0, 0)]);
        if text == "before hello" {
            h.core.handle_session_opened(h.now, SessionId(1), SessionRole::Host);
        } else {
            h.hello(1, 1, &["a"]);
            h.settle();
        }
        for m in messages {
            h.host(1, m);
        }
        let actions = h.actions();
        assert!(
            actions.iter().any(|a| matches!(a, ElementAction::Send { message: ElementMessage::Refused { reason, .. }, .. } if reason.contains(text))),
            "{text}: {actions:?}"
        );
        assert!(actions.contains(&ElementAction::Close { session: SessionId(1) }), "{text}");
    }
}

// ----- replay recovery ------------------------------------------------------------------------

/// Start a replay of volume "a" (applied at `applied`, epoch 1) through `through` from "peer".
fn replaying(applied_at: u64, through: u64, rate: u64, config: ElementConfig) -> Harness {
    let mut h = Harness::with_config(config, 1, &[("a", applied_at, 1)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    h.host(
        1,
        HostMessage::Recover {
            volume: VolumeId(0),
            source: "peer".into(),
            after: Sequence(applied_at),
            through: Sequence(through),
            rate_bytes_per_s: rate,
        },
    );
    let actions = h.actions();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, ElementAction::ConnectPeer { peer: PeerId(1), address, .. } if address == "peer")),
        "{actions:?}"
    );
    h
}

fn peer(h: &mut Harness, message: ElementMessage) {
    h.core.handle_peer_message(h.now, PeerId(1), message);
}

fn peer_sends(actions: &[ElementAction]) -> Vec<HostMessage> {
    actions
        .iter()
        .filter_map(|a| match a {
            ElementAction::SendPeer { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn replay_keeps_current_writes_and_commits_them_after_the_gap() {
    let mut h = replaying(0, 3, 0, ElementConfig::default());
    // Current writes arrive while the gap is pulled: kept aside, not faulted as a gap.
    h.host(1, HostMessage::Apply(record(0, 1, 4)));
    h.host(1, HostMessage::Apply(record(0, 1, 5)));
    assert_eq!(h.sent(), vec![]);
    peer(&mut h, welcome(1, &[(9, 1)]));
    let fetch = peer_sends(&h.actions());
    assert!(matches!(&fetch[..], [HostMessage::FetchLog { after: Sequence(0), .. }]), "{fetch:?}");
    peer(
        &mut h,
        ElementMessage::LogRecords {
            request_id: 1,
            result: Ok(vec![record(0, 1, 1), record(0, 1, 2), record(0, 1, 3)]),
        },
    );
    let actions = h.actions();
    assert!(actions.contains(&ElementAction::ClosePeer { peer: PeerId(1) }), "{actions:?}");
    let sent = h.settle();
    assert_eq!(
        sent,
        vec![
            (1, applied(0, 3)),
            (1, applied(0, 5)),
            (1, ElementMessage::RecoveryDone { volume: VolumeId(0), result: Ok(Sequence(5)) })
        ]
    );
    // Streaming again: the next current write commits directly.
    h.host(1, HostMessage::Apply(record(0, 1, 6)));
    assert_eq!(h.settle(), vec![(1, applied(0, 6))]);
}

#[test]
fn replay_checks_its_newest_record_against_the_peer_first() {
    // (own epoch at sequence 2, the peer's record 2 epoch or none) → proceeds or the reason.
    let table: [(u64, Option<u64>, Option<&str>); 3] =
        [(1, Some(1), None), (1, Some(2), Some("diverged")), (1, None, Some("does not hold sequence 2"))];
    for (_own, theirs, failure) in table {
        let mut h = replaying(2, 4, 0, ElementConfig::default());
        peer(&mut h, welcome(1, &[(4, 1)]));
        let probe = peer_sends(&h.actions());
        assert!(matches!(&probe[..], [HostMessage::FetchLog { request_id: 0, after: Sequence(1), .. }]), "{probe:?}");
        let records = theirs.map(|e| vec![record(0, e, 2)]).unwrap_or_default();
        peer(&mut h, ElementMessage::LogRecords { request_id: 0, result: Ok(records) });
        let actions = h.actions();
        match failure {
            None => assert!(
                matches!(&peer_sends(&actions)[..], [HostMessage::FetchLog { request_id: 1, after: Sequence(2), .. }]),
                "{actions:?}"
            ),
            Some(text) => assert!(
                actions.iter().any(|a| matches!(a,
                    ElementAction::Send { message: ElementMessage::RecoveryDone { result: Err(reason), .. }, .. } if reason.contains(text))),
                "{text}: {actions:?}"
            ),
        }
    }
}

#[test]
fn a_failed_replay_drops_current_writes_until_a_new_order() {
    let mut h = replaying(0, 3, 0, ElementConfig::default());
    h.host(1, HostMessage::Apply(record(0, 1, 4)));
    h.core.handle_peer_closed(h.now, PeerId(1), "peer closed the connection".into());
    let sent = h.sent();
    assert!(
        matches!(&sent[..], [(1, ElementMessage::RecoveryDone { result: Err(r), .. })] if r.contains("closed")),
        "{sent:?}"
    );
    // Still beyond the gap: dropped, not a fault (the host element orders the next attempt).
    h.host(1, HostMessage::Apply(record(0, 1, 5)));
    assert_eq!(h.settle(), vec![]);
}

#[test]
fn replay_is_paced_and_waits_for_a_peer_that_has_nothing_yet() {
    // 4 KiB records at 4 KiB/s: each fetch of one record is due a second after the previous.
    let config = ElementConfig { replay_fetch_bytes: 1, ..ElementConfig::default() };
    let mut h = replaying(0, 2, 4096, config);
    peer(&mut h, welcome(1, &[(0, 0)]));
    h.actions();
    // The peer has nothing yet: asked again after the retry interval.
    peer(&mut h, ElementMessage::LogRecords { request_id: 1, result: Ok(vec![]) });
    assert_eq!(peer_sends(&h.actions()), vec![]);
    h.advance_ms(REPLAY_EMPTY_RETRY_MS);
    assert_eq!(peer_sends(&h.actions()).len(), 1);
    peer(&mut h, ElementMessage::LogRecords { request_id: 2, result: Ok(vec![record(0, 1, 1)]) });
    h.settle();
    assert_eq!(peer_sends(&h.actions()), vec![], "paced: not yet");
    h.advance_ms(500);
    assert_eq!(peer_sends(&h.actions()), vec![], "paced: not yet");
    h.advance_ms(600);
    let fetch = peer_sends(&h.actions());
    assert!(matches!(&fetch[..], [HostMessage::FetchLog { request_id: 3, after: Sequence(1), .. }]), "{fetch:?}");
}

#[test]
fn replay_gives_up_on_a_peer_idle_too_long() {
    let mut h = replaying(0, 2, 0, ElementConfig::default());
    peer(&mut h, welcome(1, &[(0, 0)]));
    h.actions();
    for request_id in 1..=(REPLAY_IDLE_TIMEOUT_MS / 1000 + 2) {
        peer(&mut h, ElementMessage::LogRecords { request_id, result: Ok(vec![]) });
        h.advance_ms(1000);
    }
    let sent = h.sent();
    assert!(
        sent.iter().any(
            |(_, m)| matches!(m, ElementMessage::RecoveryDone { result: Err(r), .. } if r.contains("nothing after"))
        ),
        "{sent:?}"
    );
}

#[test]
fn a_peer_that_does_not_answer_fails_the_replay_but_a_paced_wait_does_not() {
    // (answers the connection, answers the first fetch) → the replay fails for silence.
    for (welcomes, answers_fetch) in [(false, false), (true, false), (true, true)] {
        // 4 KiB/s: after one 4 KiB record the pace waits a second, far below the timeout
        // with this pace, so only silence counts.
        let config = ElementConfig { replay_fetch_bytes: 1, replay_idle_timeout_ms: 2_000, ..ElementConfig::default() };
        let mut h = replaying(0, 2, 4096, config);
        if welcomes {
            peer(&mut h, welcome(1, &[(2, 1)]));
        }
        if answers_fetch {
            peer(&mut h, ElementMessage::LogRecords { request_id: 1, result: Ok(vec![record(0, 1, 1)]) });
        }
        h.settle();
        h.advance_ms(1_900);
        let early = h.sent();
        assert!(!early.iter().any(|(_, m)| matches!(m, ElementMessage::RecoveryDone { .. })), "{early:?}");
        h.advance_ms(200);
        let sent = h.sent();
        let failed = sent.iter().any(
            |(_, m)| matches!(m, ElementMessage::RecoveryDone { result: Err(r), .. } if r.contains("did not answer")),
        );
        // After an answered fetch the pace (1 s) asked again at 1 s: 2.1 s is within its timeout.
        assert_eq!(failed, !answers_fetch, "welcomes {welcomes}, answers {answers_fetch}: {sent:?}");
    }
}

#[test]
fn an_overflowing_stash_pulls_the_rest_from_the_peer() {
    // Room for two 4 KiB records only.
    let config = ElementConfig { replay_stash_bytes_max: 2 * 4096, ..ElementConfig::default() };
    let mut h = replaying(0, 2, 0, config);
    for s in 3..=6 {
        h.host(1, HostMessage::Apply(record(0, 1, s)));
    }
    peer(&mut h, welcome(1, &[(6, 1)]));
    h.actions();
    peer(&mut h, ElementMessage::LogRecords { request_id: 1, result: Ok(vec![record(0, 1, 1), record(0, 1, 2)]) });
    // 3 and 4 came from the stash; 5 and 6 were dropped: pulled on from 4 through 6.
    let fetch = peer_sends(&h.actions());
    assert!(matches!(&fetch[..], [HostMessage::FetchLog { after: Sequence(4), .. }]), "{fetch:?}");
    h.settle();
    peer(&mut h, ElementMessage::LogRecords { request_id: 2, result: Ok(vec![record(0, 1, 5), record(0, 1, 6)]) });
    let sent = h.settle();
    assert_eq!(
        sent.last(),
        Some(&(1, ElementMessage::RecoveryDone { volume: VolumeId(0), result: Ok(Sequence(6)) })),
        "{sent:?}"
    );
}

#[test]
fn a_paced_replay_whose_stash_overflows_is_no_longer_paced() {
    // Every action until storage idles (commits done), storage's own jobs included.
    fn run(h: &mut Harness) -> Vec<ElementAction> {
        let mut all = h.actions();
        while h.storage.is_some() {
            h.storage_done();
            all.extend(h.actions());
        }
        all
    }
    // 4 KiB/s: one 4 KiB record a second, paced; room in the stash for one record.
    let config = ElementConfig { replay_fetch_bytes: 1, replay_stash_bytes_max: 4096, ..ElementConfig::default() };
    let mut h = replaying(0, 3, 4096, config);
    peer(&mut h, welcome(1, &[(3, 1)]));
    h.actions();
    peer(&mut h, ElementMessage::LogRecords { request_id: 1, result: Ok(vec![record(0, 1, 1)]) });
    assert_eq!(peer_sends(&run(&mut h)), vec![], "paced while the stash has room");
    // Current writes 4 (kept) and 5 (no room): from now on the pull is not paced.
    h.host(1, HostMessage::Apply(record(0, 1, 4)));
    h.host(1, HostMessage::Apply(record(0, 1, 5)));
    h.advance_ms(1000);
    let fetch = peer_sends(&run(&mut h));
    assert!(matches!(&fetch[..], [HostMessage::FetchLog { request_id: 2, after: Sequence(1), .. }]), "{fetch:?}");
    peer(&mut h, ElementMessage::LogRecords { request_id: 2, result: Ok(vec![record(0, 1, 2)]) });
    let fetch = peer_sends(&run(&mut h));
    assert!(
        matches!(&fetch[..], [HostMessage::FetchLog { request_id: 3, after: Sequence(2), .. }]),
        "at once: {fetch:?}"
    );
    peer(&mut h, ElementMessage::LogRecords { request_id: 3, result: Ok(vec![record(0, 1, 3)]) });
    // 4 from the stash; 5 was dropped: pulled on, still unpaced.
    let fetch = peer_sends(&run(&mut h));
    assert!(
        matches!(&fetch[..], [HostMessage::FetchLog { request_id: 4, after: Sequence(4), .. }]),
        "at once: {fetch:?}"
    );
    peer(&mut h, ElementMessage::LogRecords { request_id: 4, result: Ok(vec![record(0, 1, 5)]) });
    let sent = h.settle();
    assert_eq!(
        sent.last(),
        Some(&(1, ElementMessage::RecoveryDone { volume: VolumeId(0), result: Ok(Sequence(5)) })),
        "{sent:?}"
    );
}

#[test]
fn closing_the_ordering_session_stops_the_replay() {
    let mut h = replaying(0, 3, 0, ElementConfig::default());
    h.core.handle_session_closed(h.now, SessionId(1));
    assert!(h.actions().contains(&ElementAction::ClosePeer { peer: PeerId(1) }));
    // A late answer of the peer changes nothing.
    peer(&mut h, welcome(1, &[(3, 1)]));
    assert_eq!(h.actions(), vec![]);
}

#[test]
fn a_replay_a_superseded_host_element_ordered_stops_when_a_newer_one_is_adopted() {
    // The ordering host element is paused, its session still open; its replay's peer has
    // nothing (yet). A newer host element's records past the old order are committed, not kept
    // for a pull that may never end (found with swarm seed 532 once host elements began with a
    // record at once).
    let mut h = replaying(0, 3, 0, ElementConfig::default());
    peer(&mut h, welcome(1, &[(0, 1)]));
    h.actions();
    h.hello_from(2, 2, HostId(2), &["a"]);
    h.storage_done(); // the epoch adopted
    let actions = h.actions();
    assert!(actions.contains(&ElementAction::ClosePeer { peer: PeerId(1) }), "{actions:?}");
    assert!(
        actions.iter().any(|a| matches!(a, ElementAction::Send { session: SessionId(1), message: ElementMessage::RecoveryDone { result: Err(reason), .. } } if reason.contains("superseded"))),
        "{actions:?}"
    );
    // The new host element sends what the element lacks, then its own records: all committed.
    for sequence in 1..=4 {
        let epoch = if sequence == 4 { 2 } else { 1 };
        h.host(2, HostMessage::Apply(record(0, epoch, sequence)));
    }
    let sent = h.settle();
    assert_eq!(sent.last(), Some(&(2, applied(0, 4))), "{sent:?}");
}

// ----- full recovery and copy sources ---------------------------------------------------------

#[test]
fn a_copy_source_waits_for_the_sequence_asked() {
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.hello(1, 1, &["a"]);
    h.peer_hello(2, 1, &["a"]);
    h.settle();
    let fetch = |request_id, min| HostMessage::FetchBlocks {
        request_id,
        volume: VolumeId(0),
        first_block: 0,
        min_applied: Sequence(min),
        have: vec![],
        snapshot: None,
    };
    h.host(2, fetch(1, 1));
    h.host(2, fetch(2, 5));
    assert!(!h.actions().iter().any(|a| matches!(a, ElementAction::Serve { .. })));
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    h.actions();
    h.storage_done();
    // Served as soon as sequence 1 is applied; the other still waits.
    let served: Vec<u64> = h
        .actions()
        .into_iter()
        .filter_map(|a| match a {
            ElementAction::Serve {
                session: SessionId(2),
                request: HostMessage::FetchBlocks { request_id, .. },
                ..
            } => Some(request_id),
            _ => None,
        })
        .collect();
    assert_eq!(served, vec![1]);
    h.advance_ms(SOURCE_CATCH_UP_TIMEOUT_MS + 1);
    let sent = h.sent();
    assert!(
        sent.iter().any(|(s, m)| *s == 2
            && matches!(m, ElementMessage::Blocks { request_id: 2, result: Err(r) } if r.contains("needs 5"))),
        "{sent:?}"
    );
}

/// A read of a snapshot waits until the element has applied the sequence it names (its
/// record may still be on its way), and fails if it waited too long; a volume numbered past
/// the snapshots storage made meanwhile joins the list.
#[test]
fn a_snapshot_read_waits_for_its_record() {
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    let read = |request_id, taken_at| HostMessage::Read {
        request_id,
        volume: VolumeId(0),
        offset_bytes: 0,
        length_bytes: 4096,
        snapshot: Some(proto::SnapshotRef { id: 9, taken_at: Sequence(taken_at) }),
    };
    h.host(1, read(1, 1));
    h.host(1, read(2, 5));
    assert!(!h.actions().iter().any(|a| matches!(a, ElementAction::Serve { .. })), "both wait");
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    h.actions();
    h.storage_done();
    let served: Vec<u64> = h
        .actions()
        .into_iter()
        .filter_map(|a| match a {
            ElementAction::Serve { request: HostMessage::Read { request_id, .. }, volume: LocalVolume(0), .. } => {
                Some(request_id)
            }
            _ => None,
        })
        .collect();
    assert_eq!(served, vec![1], "served once sequence 1 is applied (storage finds the snapshot)");
    h.advance_ms(SOURCE_CATCH_UP_TIMEOUT_MS + 1);
    let sent = h.sent();
    assert!(
        sent.iter().any(|(s, m)| *s == 1
            && matches!(m, ElementMessage::ReadReply { request_id: 2, result: Err(r), .. } if r.contains("taken at 5"))),
        "{sent:?}"
    );
    // Storage numbered a snapshot (1) among volumes: the next new volume is 2.
    h.held.push((Sequence::ZERO, Epoch(0)));
    h.hello(3, 1, &["a", "b"]);
    h.settle();
    assert_eq!(h.core.volumes.len(), 3, "the snapshot's number is a placeholder");
    assert!(h.core.volumes[1].removed && h.core.volumes[2].spec.name == "b");
}

#[test]
fn copy_orders_run_one_at_a_time() {
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    let copy = HostMessage::Copy { volume: VolumeId(0), source: "peer".into(), rate_bytes_per_s: 0 };
    h.host(1, copy.clone());
    assert!(h.actions().iter().any(|a| matches!(a, ElementAction::StartCopy { .. })));
    h.host(1, HostMessage::Apply(record(0, 1, 1))); // Superseded by the copy: dropped.
    h.hello(2, 1, &["a"]);
    let sent = h.settle();
    // A session that arrives meanwhile is told the volume is being copied.
    assert!(
        sent.iter().any(|(s, m)| *s == 2 && matches!(m, ElementMessage::Welcome { volumes, .. } if volumes[0].copying)),
        "{sent:?}"
    );
    h.host(2, copy);
    assert!(!h.actions().iter().any(|a| matches!(a, ElementAction::StartCopy { .. })), "waits for the running copy");
    let info = VolumeInfo { applied: Sequence(7), applied_epoch: Epoch(1), copying: false, repair: false };
    h.core.handle_copy_done(h.now, LocalVolume(0), VolumeId(0), info, Ok(Sequence(7)));
    let actions = h.actions();
    assert!(actions.iter().any(|a| matches!(a, ElementAction::StartCopy { session: SessionId(2), .. })), "{actions:?}");
    assert!(actions.iter().any(|a| matches!(
        a,
        ElementAction::Send {
            session: SessionId(1),
            message: ElementMessage::CopyDone { result: Ok(Sequence(7)), .. }
        }
    )));
}

/// Records queued behind a commit when a copy is ordered are superseded by the copy, not
/// refused: a fault then would fail the element in the middle of its full recovery (CI saw
/// records refused with a gap after a copy resumed, 2026-11-29).
#[test]
fn records_queued_before_a_copy_are_superseded_not_refused() {
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    assert_eq!(h.sent(), vec![]);
    assert!(matches!(&h.storage, Some(StorageJob::Commit(_))));
    // Queued behind the commit in flight: one that follows, one after a gap.
    h.host(1, HostMessage::Apply(record(0, 1, 2)));
    h.host(1, HostMessage::Apply(record(0, 1, 9)));
    h.host(1, HostMessage::Copy { volume: VolumeId(0), source: "peer".into(), rate_bytes_per_s: 0 });
    assert!(h.actions().iter().any(|a| matches!(a, ElementAction::StartCopy { .. })));
    let sent = h.settle();
    assert!(!sent.iter().any(|(_, m)| is_fault(m, "")), "{sent:?}");
    assert_eq!(sent, vec![(1, applied(0, 1))], "only the commit that was under way is acknowledged");
    assert_eq!(h.held[0].0, Sequence(1), "nothing was stored after the copy began");
}

/// An element restarted in the middle of a copy takes no records before the copy resumes, and
/// sends no receipt for them.
#[test]
fn an_interrupted_copy_takes_no_records_before_it_resumes() {
    let info = VolumeInfo { applied: Sequence(5), applied_epoch: Epoch(1), copying: true, repair: false };
    let mut core = ElementCore::new(ElementConfig::default(), Epoch(1), HOST, vec![(spec("a"), info)]);
    core.handle_timeout(Time(0));
    let mut h =
        Harness { core, now: Time(1_000_000), storage: None, held: vec![(Sequence(5), Epoch(1))], pending: Vec::new() };
    h.hello(1, 1, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 9)));
    h.host(1, HostMessage::Apply(record(0, 1, 10)));
    let sent = h.settle();
    assert!(h.storage.is_none());
    assert!(!sent.iter().any(|(_, m)| is_fault(m, "") || matches!(m, ElementMessage::Applied { .. })), "{sent:?}");
    assert_eq!(h.held[0].0, Sequence(5));
}

// ----- read lease and takeover ------------------------------------------------------------------

fn pong_lease(sent: &[(u64, ElementMessage)], session: u64) -> Option<u32> {
    sent.iter().find_map(|(s, m)| match m {
        ElementMessage::Pong { lease_ms, .. } if *s == session => Some(*lease_ms),
        _ => None,
    })
}

fn adopting(h: &Harness) -> bool {
    matches!(h.storage, Some(StorageJob::AdoptEpoch(..)))
}

#[test]
fn a_newer_host_element_waits_for_the_read_lease_promised_to_the_holder() {
    let other = HostId(2);
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.host(1, HostMessage::Ping { nonce: 1 });
    assert_eq!(pong_lease(&h.sent(), 1), Some(LEASE_MS_DEFAULT as u32), "a pong of the holder's session promises");
    // A newer host element's hello waits for the promise to run out...
    h.hello_from(2, 7, other, &["a"]);
    let sent = h.sent();
    assert!(!adopting(&h), "{sent:?}");
    // ...and no new promise is made meanwhile, so the holder's lease ends.
    h.advance_ms(LEASE_MS_DEFAULT / 2);
    h.host(1, HostMessage::Ping { nonce: 2 });
    let sent = h.sent();
    assert_eq!(pong_lease(&sent, 1), Some(0));
    assert!(!adopting(&h));
    h.advance_ms(LEASE_MS_DEFAULT / 2 - 1);
    h.sent();
    assert!(!adopting(&h), "not one millisecond early");
    h.advance_ms(1);
    let sent = h.sent();
    assert!(adopting(&h), "{sent:?}");
    let sent = h.settle();
    assert!(sent.iter().any(|(s, m)| *s == 2 && matches!(m, ElementMessage::Welcome { .. })), "{sent:?}");
    // The old holder's records are fenced now.
    h.host(1, HostMessage::Apply(record(0, 5, 1)));
    let sent = h.settle();
    assert!(sent.iter().any(|(s, m)| *s == 1 && is_fault(m, "fenced")), "{sent:?}");
}

#[test]
fn no_lease_is_promised_while_a_newer_epoch_is_being_adopted() {
    // Found by the simulator (swarm seed 1644 of one build): the holder's ping arrived just
    // after the lease had run out and a newer host element's epoch was being adopted; the pong
    // promised a new lease, and the welcome broke it at once (the old host element answered a
    // stale read from its cache while the new one had acknowledged a write).
    let other = HostId(2);
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.advance_ms(LEASE_MS_DEFAULT);
    h.hello_from(2, 7, other, &["a"]);
    h.sent();
    assert!(adopting(&h), "no lease runs: the newer epoch is adopted at once");
    h.host(1, HostMessage::Ping { nonce: 1 });
    assert_eq!(pong_lease(&h.sent(), 1), Some(0), "no promise the welcome would break");
    let sent = h.settle();
    assert!(sent.iter().any(|(s, m)| *s == 2 && matches!(m, ElementMessage::Welcome { .. })), "{sent:?}");
}

#[test]
fn a_released_lease_lets_a_standby_in_at_once_and_says_the_owner_is_gone() {
    let other = HostId(2);
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.host(1, HostMessage::Ping { nonce: 1 });
    h.sent();
    // A standby's observer session: no hello needed.
    h.core.handle_session_opened(h.now, SessionId(9), SessionRole::Host);
    h.host(9, HostMessage::Observe { nonce: 4 });
    let sent = h.sent();
    assert!(
        sent.iter().any(|(s, m)| *s == 9
            && matches!(m, ElementMessage::Observed { nonce: 4, epoch: Epoch(5), owner_absent_ms: 0, .. })),
        "{sent:?}"
    );
    h.host(1, HostMessage::Release);
    // Its pings may still come before its sessions close: no promise any more.
    h.host(1, HostMessage::Ping { nonce: 2 });
    assert_eq!(pong_lease(&h.sent(), 1), Some(0));
    h.host(9, HostMessage::Observe { nonce: 5 });
    let sent = h.sent();
    assert!(
        sent.iter().any(|(s, m)| *s == 9
            && matches!(m, ElementMessage::Observed { owner_absent_ms, .. } if *owner_absent_ms >= OWNER_RELEASED_ABSENT_MS)),
        "{sent:?}"
    );
    h.hello_from(2, 6, other, &["a"]);
    h.sent();
    assert!(matches!(h.storage, Some(StorageJob::AdoptEpoch(Epoch(6), _))), "no wait after a release");
}

#[test]
fn a_silent_holder_counts_as_absent_and_a_restarted_element_keeps_its_promise() {
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.core.handle_session_opened(h.now, SessionId(9), SessionRole::Host);
    let absent = |h: &mut Harness, nonce: u64| {
        h.host(9, HostMessage::Observe { nonce });
        h.sent()
            .into_iter()
            .find_map(|(_, m)| match m {
                ElementMessage::Observed { owner_absent_ms, .. } => Some(owner_absent_ms),
                _ => None,
            })
            .expect("observed")
    };
    h.advance_ms(OWNER_SILENCE_MS_DEFAULT - 1);
    assert_eq!(absent(&mut h, 1), 0, "an open session that spoke lately");
    h.advance_ms(1);
    assert_eq!(absent(&mut h, 2), OWNER_SILENCE_MS_DEFAULT, "a paused host element keeps its session open");
    h.host(1, HostMessage::Ping { nonce: 3 });
    assert_eq!(absent(&mut h, 4), 0);

    // A freshly started element that followed epoch 5 makes a newer one wait a full lease.
    let config = ElementConfig { lease_ms: 300, ..ElementConfig::default() };
    let mut fresh = ElementCore::new(config, Epoch(5), HOST, vec![]);
    fresh.handle_session_opened(Time(10_000_000), SessionId(1), SessionRole::Host);
    fresh.handle_host_message(
        Time(10_000_000),
        SessionId(1),
        HostMessage::Hello {
            epoch: Epoch(6),
            host: HostId(3),
            volumes: vec![],
            admin: "x".into(),
            receipt_acks: false,
        },
    );
    let mut actions = Vec::new();
    while let Some(a) = fresh.poll_action() {
        actions.push(a);
    }
    fresh.handle_volumes_ensured(Time(10_000_000), SessionId(1), Ok(vec![]));
    while let Some(a) = fresh.poll_action() {
        actions.push(a);
    }
    assert!(!actions.iter().any(|a| matches!(a, ElementAction::Storage(StorageJob::AdoptEpoch(..)))), "{actions:?}");
    assert_eq!(fresh.poll_timeout(), Some(Time(10_300_000)));
    fresh.handle_timeout(Time(10_300_000));
    let mut adopted = false;
    while let Some(a) = fresh.poll_action() {
        adopted |= matches!(a, ElementAction::Storage(StorageJob::AdoptEpoch(Epoch(6), _)));
    }
    assert!(adopted);
}

#[test]
fn a_superseded_host_elements_recovery_orders_are_refused() {
    // A host element that wakes from a pause still has its session open, and may send a
    // recovery order from before: it must not rebuild a volume under the newer one's stream.
    let other = HostId(2);
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.hello_from(2, 6, other, &["a"]);
    h.settle();
    h.host(1, HostMessage::Copy { volume: VolumeId(0), source: "127.0.0.1:1".into(), rate_bytes_per_s: 0 });
    let actions = h.actions();
    assert!(!actions.iter().any(|a| matches!(a, ElementAction::StartCopy { .. })), "{actions:?}");
    assert!(
        actions.iter().any(|a| matches!(a, ElementAction::Send { session: SessionId(1), message: ElementMessage::Refused { reason, .. } } if reason.contains("fenced"))),
        "{actions:?}"
    );
}

#[test]
fn a_recovery_order_late_on_a_host_elements_old_session_is_refused() {
    // The host element reconnected (it closed the old session first) and streams records on
    // the new one; recovery orders it sent on the old one before arrive late, over a slow
    // link (swarm seed 650 of `--volume-ops`).
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.hello(2, 5, &["a"]);
    h.settle();
    h.host(2, HostMessage::Apply(record(0, 5, 1)));
    assert_eq!(h.settle(), vec![(2, applied(0, 1))]);
    h.host(1, HostMessage::Copy { volume: VolumeId(0), source: "127.0.0.1:1".into(), rate_bytes_per_s: 0 });
    h.host(
        1,
        HostMessage::Recover {
            volume: VolumeId(0),
            source: "127.0.0.1:1".into(),
            after: Sequence(0),
            through: Sequence(1),
            rate_bytes_per_s: 0,
        },
    );
    let actions = h.actions();
    assert!(
        !actions.iter().any(|a| matches!(a, ElementAction::StartCopy { .. } | ElementAction::ConnectPeer { .. })),
        "{actions:?}"
    );
    let refused = |a: &ElementAction| match a {
        ElementAction::Send { session: SessionId(1), message: ElementMessage::CopyDone { result: Err(r), .. } }
        | ElementAction::Send { session: SessionId(1), message: ElementMessage::RecoveryDone { result: Err(r), .. } } => {
            r.contains("superseded")
        }
        _ => false,
    };
    assert_eq!(actions.iter().filter(|a| refused(a)).count(), 2, "{actions:?}");
    // The new session's records go on; its own orders are carried out.
    h.host(2, HostMessage::Apply(record(0, 5, 2)));
    assert_eq!(h.settle(), vec![(2, applied(0, 2))]);
    h.host(2, HostMessage::Copy { volume: VolumeId(0), source: "127.0.0.1:1".into(), rate_bytes_per_s: 0 });
    assert!(h.actions().iter().any(|a| matches!(a, ElementAction::StartCopy { session: SessionId(2), .. })));
}

/// What a session may ask depends on who opened it (its certificate's role): a peer element
/// fetches, a host element writes and sets epochs, neither does the other's part.
#[test]
fn a_sessions_role_bounds_what_it_may_ask() {
    let mut h = Harness::new(3, &[("vol0", 5, 3)]);
    let refused = |h: &mut Harness, session: u64| {
        h.sent().into_iter().any(|(s, m)| s == session && matches!(m, ElementMessage::Refused { .. }))
    };
    // A peer may not raise the epoch (the attack that fences every host element forever).
    h.core.handle_session_opened(h.now, SessionId(1), SessionRole::Element);
    let hello = |epoch: u64, name: &str| HostMessage::Hello {
        epoch: Epoch(epoch),
        host: HOST,
        volumes: vec![spec(name)],
        admin: String::new(),
        receipt_acks: false,
    };
    h.host(1, hello(u64::MAX, "vol0"));
    assert!(refused(&mut h, 1));
    assert_eq!(h.core.epoch(), Epoch(3));
    assert!(h.storage.is_none(), "nothing adopted");
    // Nor create a volume.
    h.core.handle_session_opened(h.now, SessionId(2), SessionRole::Element);
    h.host(2, hello(3, "other"));
    assert!(refused(&mut h, 2));
    // At the current epoch, for a volume that exists, it is welcomed and may fetch the log, but
    // not write.
    h.core.handle_session_opened(h.now, SessionId(3), SessionRole::Element);
    h.host(3, hello(3, "vol0"));
    let actions = h.actions();
    assert!(actions.contains(&ElementAction::EnsureVolumes { session: SessionId(3), specs: vec![spec("vol0")] }));
    h.core.handle_volumes_ensured(
        h.now,
        SessionId(3),
        Ok(vec![(
            LocalVolume(0),
            VolumeInfo { applied: Sequence(5), applied_epoch: Epoch(3), copying: false, repair: false },
        )]),
    );
    assert!(h.sent().iter().any(|(s, m)| *s == 3 && matches!(m, ElementMessage::Welcome { .. })));
    h.host(3, HostMessage::FetchLog { request_id: 1, volume: VolumeId(0), after: Sequence(4), max_bytes: 1 << 20 });
    assert!(h.actions().iter().any(|a| matches!(a, ElementAction::Serve { session: SessionId(3), .. })));
    h.host(3, HostMessage::Apply(record(0, 3, 6)));
    assert!(refused(&mut h, 3));
    assert!(h.storage.is_none(), "the write was not committed");
    // A host element writes, but does not copy blocks out (an element's part).
    h.hello(4, 3, &["vol0"]);
    h.actions();
    let fetch = HostMessage::FetchBlocks {
        request_id: 2,
        volume: VolumeId(0),
        first_block: 0,
        min_applied: Sequence(0),
        have: Vec::new(),
        snapshot: None,
    };
    h.host(4, fetch.clone());
    assert!(refused(&mut h, 4));
    // Without authentication (a loopback-only cluster) the rules are as they always were.
    assert_eq!(role_refusal(SessionRole::Unauthenticated, &fetch, Epoch(3)), None);
    assert_eq!(role_refusal(SessionRole::Element, &fetch, Epoch(3)), None);
}

/// A hello far beyond the element's epoch (2^64 − 1) would fence every host element for good:
/// refused, with the element's epoch, so a real host element takes the next one instead.
#[test]
fn an_epoch_jump_beyond_the_bound_is_refused() {
    let mut h = Harness::new(3, &[("vol0", 0, 0)]);
    h.hello(1, u64::MAX, &["vol0"]);
    let refused = h.sent().into_iter().any(|(s, m)| {
        s == 1 && matches!(m, ElementMessage::Refused { epoch: Some(Epoch(3)), ref reason, .. } if reason.contains("jumps"))
    });
    assert!(refused);
    assert_eq!(h.core.epoch(), Epoch(3));
    // The next epoch is fine.
    h.hello(2, 4, &["vol0"]);
    h.settle();
    assert_eq!(h.core.epoch(), Epoch(4));
}

/// A `ResizeVolumes` is a storage job behind the commits queued before it; what the session
/// sends after it (a record into the new blocks, a read of them) waits until the grow is done,
/// and a grow storage refuses ends the session.
#[test]
fn a_resize_runs_after_the_records_before_it_and_before_anything_after_it() {
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    h.hello(1, 5, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 5, 1)));
    h.host(1, HostMessage::ResizeVolumes { volumes: vec![(VolumeId(0), 128 * MB)] });
    h.host(
        1,
        HostMessage::Read {
            request_id: 7,
            volume: VolumeId(0),
            offset_bytes: 100 * MB,
            length_bytes: 4096,
            snapshot: None,
        },
    );
    h.host(1, HostMessage::Apply(record(0, 5, 2)));
    // Record 1 is being committed; the resize, the read and record 2 wait.
    let actions = h.actions();
    assert!(
        matches!(&actions[..], [ElementAction::Storage(StorageJob::Commit(batch))] if batch.len() == 1),
        "{actions:?}"
    );
    h.storage_done();
    let actions = h.actions();
    assert!(
        actions
            .iter()
            .any(|a| *a == ElementAction::Storage(StorageJob::ResizeVolumes(vec![(LocalVolume(0), 128 * MB)]))),
        "the grow follows record 1: {actions:?}"
    );
    assert!(!actions.iter().any(|a| matches!(a, ElementAction::Serve { .. })), "the read waits: {actions:?}");
    h.storage_done();
    let actions = h.actions();
    let resized = actions.iter().position(|a| {
        matches!(a, ElementAction::Send { message: ElementMessage::VolumesResized { volumes }, .. } if volumes == &vec![VolumeId(0)])
    });
    let served = actions.iter().position(|a| matches!(a, ElementAction::Serve { .. }));
    assert!(resized.is_some() && served.is_some() && resized < served, "answered, then the read: {actions:?}");
    assert!(actions.iter().any(|a| matches!(a, ElementAction::Storage(StorageJob::Commit(_)))), "{actions:?}");
    h.storage_done();
    assert!(h.sent().contains(&(1, applied(0, 2))));
    // A grow storage refuses: the session ends.
    h.host(1, HostMessage::ResizeVolumes { volumes: vec![(VolumeId(0), 1 << 50)] });
    h.actions();
    let job = h.storage.take().expect("the grow is a storage job");
    assert!(matches!(job, StorageJob::ResizeVolumes(_)));
    h.core.handle_storage_done(h.now, StorageDone::ResizeVolumes(Err("no room".into())));
    let sent = h.sent();
    assert!(
        sent.iter()
            .any(|(s, m)| *s == 1
                && matches!(m, ElementMessage::Refused { reason, .. } if reason.contains("cannot grow"))),
        "{sent:?}"
    );
}

/// A hello older than one waiting for its turn creates nothing: once the newer epoch is
/// adopted it would be refused, and the volumes it named (a superseded host element's, perhaps
/// deleted since) would be left behind.
#[test]
fn a_hello_older_than_one_being_taken_creates_nothing() {
    let mut h = Harness::new(5, &[("a", 0, 0)]);
    let hello = |epoch: u64, host: HostId, names: &[&str]| HostMessage::Hello {
        epoch: Epoch(epoch),
        host,
        volumes: names.iter().map(|n| spec(n)).collect(),
        admin: String::new(),
        receipt_acks: false,
    };
    // Session 1's hello waits for its volumes to be ensured when an older hello arrives.
    h.core.handle_session_opened(h.now, SessionId(1), SessionRole::Host);
    h.host(1, hello(7, HOST, &["a"]));
    let actions = h.actions();
    assert!(actions.contains(&ElementAction::EnsureVolumes { session: SessionId(1), specs: vec![spec("a")] }));
    h.core.handle_session_opened(h.now, SessionId(2), SessionRole::Host);
    h.host(2, hello(6, HostId(9), &["a", "b"]));
    let actions = h.actions();
    assert!(
        !actions.iter().any(|a| matches!(a, ElementAction::EnsureVolumes { session: SessionId(2), .. })),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|a| matches!(a, ElementAction::Send { session: SessionId(2), message: ElementMessage::Refused { reason, epoch: None, .. } } if reason.contains("newer epoch 7"))),
        "{actions:?}"
    );
    // Session 1 goes on: welcomed at its epoch.
    let info = VolumeInfo { applied: Sequence::ZERO, applied_epoch: Epoch(0), copying: false, repair: false };
    h.core.handle_volumes_ensured(h.now, SessionId(1), Ok(vec![(LocalVolume(0), info)]));
    let sent = h.settle();
    assert!(sent.iter().any(|(s, m)| *s == 1 && matches!(m, ElementMessage::Welcome { .. })), "{sent:?}");
    assert_eq!(h.core.epoch(), Epoch(7));
}

#[test]
fn a_receipt_is_acknowledged_only_for_data_that_matches_its_pieces() {
    // A large write's frame checksum does not cover its data (proto's `body_crc`): a receipt,
    // which counts toward the write quorum under the `received` policy, checks it first.
    let mut h = Harness::new(1, &[("a", 0, 0)]);
    h.core.handle_session_opened(h.now, SessionId(1), SessionRole::Host);
    let hello = HostMessage::Hello {
        epoch: Epoch(1),
        host: HOST,
        volumes: vec![spec("a")],
        admin: String::new(),
        receipt_acks: true,
    };
    h.host(1, hello);
    h.actions();
    let info = VolumeInfo { applied: Sequence::ZERO, applied_epoch: Epoch(0), copying: false, repair: false };
    h.core.handle_volumes_ensured(h.now, SessionId(1), Ok(vec![(LocalVolume(0), info)]));
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 1)));
    let mut damaged = record(0, 1, 2);
    if let Op::Write { data, .. } = &mut damaged.op {
        let mut bytes = data.to_vec();
        bytes[7] ^= 1;
        *data = Bytes::from(bytes);
    }
    h.host(1, HostMessage::Apply(damaged));
    let received: Vec<Sequence> = h
        .sent()
        .into_iter()
        .filter_map(|(_, m)| match m {
            ElementMessage::Received { sequence, .. } => Some(sequence),
            _ => None,
        })
        .collect();
    assert_eq!(received, vec![Sequence(1)]);
}

/// A gap refuses every record after it: the session hears one fault (which fails it), not one
/// per record (the host element counted each as another failure, and the log of a CI failure
/// of 2026-11-29 was nothing but them).
#[test]
fn a_burst_of_refused_records_is_one_fault() {
    let mut h = Harness::new(1, &[("a", 3, 1)]);
    h.hello(1, 1, &["a"]);
    h.settle();
    h.host(1, HostMessage::Apply(record(0, 1, 4)));
    // Queued behind the commit in flight, all after a gap.
    for sequence in 6..10 {
        h.host(1, HostMessage::Apply(record(0, 1, sequence)));
    }
    let sent = h.settle();
    let faults = sent.iter().filter(|(s, m)| *s == 1 && is_fault(m, "leaves a gap")).count();
    assert_eq!(faults, 1, "{sent:?}");
    assert!(sent.contains(&(1, applied(0, 4))), "{sent:?}");
    assert_eq!(h.core.applied(LocalVolume(0)), Sequence(4));
}
