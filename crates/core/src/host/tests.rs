//! Tests of the host core against real element cores ([`ElementCore`] over in-memory storage),
//! connected synchronously: every message is delivered at once, in order.

use std::collections::VecDeque;

use super::*;
use crate::element::{
    ElementAction, ElementConfig, ElementCore, LocalVolume, PeerId, SessionId, StorageDone, StorageJob,
};
use crate::mem_storage::MemStorage;
use crate::storage::ElementStorage;

const VOLUME: VolumeId = VolumeId(0);
const SIZE: u64 = 32 << 20;

/// An element: the real core over in-memory storage, and the switches the tests turn.
struct TestElement {
    core: ElementCore,
    storage: MemStorage,
    /// Reachable: messages to and from it are delivered.
    connected: bool,
    /// Its process was killed: the next connection boots a new core from what storage holds.
    down: bool,
    /// Storage jobs complete at once; otherwise the one under way waits for `release`.
    responsive: bool,
    /// The storage job written but not yet reported durable (while not responsive).
    held: Option<StorageDone>,
    /// Its session with the host element.
    session: Option<SessionId>,
    /// Full recoveries (block copies) it went through.
    copies: u32,
    /// Its sessions to peers never get an answer (a hung connection).
    peers_unreachable: bool,
    /// The identity its storage keeps.
    id: u64,
}

impl TestElement {
    fn new(id: u64) -> TestElement {
        // Room for a volume twice as large as the one every element holds.
        let mut storage = MemStorage::new(2 * SIZE, 0, u64::MAX, true);
        storage.add_volume("vol0".into(), SIZE);
        TestElement {
            core: Self::boot(&storage, id),
            id,
            storage,
            connected: false,
            down: false,
            responsive: true,
            held: None,
            session: None,
            copies: 0,
            peers_unreachable: false,
        }
    }

    /// A core for every volume storage holds (as the element starts; a removed one with size 0).
    fn boot(storage: &MemStorage, id: u64) -> ElementCore {
        let config = ElementConfig { element_id: id, ..ElementConfig::default() };
        let volumes = (0..storage.vols.len())
            .map(|i| {
                let v = &storage.vols[i];
                let size_bytes = if v.removed { 0 } else { v.data.len() as u64 };
                (
                    VolumeSpec { name: v.name.clone(), size_bytes, clone_of: None, at_least: false },
                    storage.info(LocalVolume(i as u32)),
                )
            })
            .collect();
        ElementCore::new(config, storage.epoch, storage.holder, volumes)
    }

    /// Durable content of the volume.
    fn data(&self) -> &[u8] {
        &self.storage.vols[0].data
    }

    fn applied(&self) -> Sequence {
        self.storage.vols[0].applied()
    }

    /// Put records straight into its storage (its history before the test's host element).
    fn install(&mut self, records: &[Record]) {
        let batch: Vec<(LocalVolume, Record)> = records.iter().map(|r| (LocalVolume(0), r.clone())).collect();
        let done = self.storage.commit(&batch).expect("commit");
        assert!(done.rejected.is_empty(), "{:?}", done.rejected);
        self.storage.sync();
        self.core = Self::boot(&self.storage, self.id);
    }
}

/// Where a message goes.
enum Delivery {
    ToElement {
        element: usize,
        session: SessionId,
        message: HostMessage,
    },
    ToHost {
        element: usize,
        session: SessionId,
        message: ElementMessage,
    },
    /// The element closed a session: after what it sent before, as over TCP.
    Closed {
        element: usize,
        session: SessionId,
    },
}

struct Cluster {
    core: HostCore,
    now: Time,
    elements: Vec<TestElement>,
    replies: HashMap<Token, Reply>,
    events: Vec<Event>,
    next_token: u64,
    next_session: u64,
    /// Sessions elements opened to peers: session → (opener, its name for it, the peer).
    peer_sessions: HashMap<SessionId, (usize, PeerId, usize)>,
    deliveries: VecDeque<Delivery>,
}

impl Cluster {
    fn new(n: usize, quorum: usize) -> Cluster {
        Cluster::with(n, quorum, |_| {})
    }

    fn with(n: usize, quorum: usize, tune: impl FnOnce(&mut HostConfig)) -> Cluster {
        let mut config = HostConfig::new(
            Epoch(5),
            quorum,
            (0..n).map(|i| format!("e{i}")).collect(),
            vec![VolumeSpec { name: "vol0".into(), size_bytes: SIZE, clone_of: None, at_least: false }],
        );
        config.read_cache_bytes = 0;
        config.element_addresses = (0..n).map(|i| format!("e{i}")).collect();
        tune(&mut config);
        let mut c = Cluster {
            core: HostCore::new(config, Time(0)),
            now: Time(0),
            elements: (0..n).map(|i| TestElement::new(i as u64 + 1)).collect(),
            replies: HashMap::new(),
            events: Vec::new(),
            next_token: 1,
            next_session: 1,
            peer_sessions: HashMap::new(),
            deliveries: VecDeque::new(),
        };
        for i in 0..n {
            c.connect(i);
        }
        c
    }

    fn open_session(&mut self, element: usize) -> SessionId {
        let session = SessionId(self.next_session);
        self.next_session += 1;
        self.elements[element].core.handle_session_opened(self.now, session, crate::SessionRole::Host);
        session
    }

    fn connect(&mut self, i: usize) {
        let e = &mut self.elements[i];
        if e.down {
            e.down = false;
            e.core = TestElement::boot(&e.storage, e.id);
        }
        e.connected = true;
        let session = self.open_session(i);
        self.elements[i].session = Some(session);
        self.core.handle_element_connected(self.now, ElementId(i as u8));
        self.run();
    }

    /// The element's process is killed (what it had written survives), and its connection
    /// with it.
    fn crash(&mut self, i: usize) {
        self.stop(i, None);
    }

    /// The element's machine loses power: what it had not synced is lost.
    fn power_loss(&mut self, i: usize) {
        self.stop(i, Some(crate::mem_storage::PowerLoss { records_kept: 0, torn: false, epoch_kept: true }));
    }

    fn stop(&mut self, i: usize, power_loss: Option<crate::mem_storage::PowerLoss>) {
        let e = &mut self.elements[i];
        e.connected = false;
        e.down = true;
        e.session = None;
        e.held = None;
        e.storage.crash(power_loss);
        self.core.handle_element_disconnected(self.now, ElementId(i as u8), "killed");
        self.run();
    }

    /// Deliver every action and message until everything is quiet.
    fn run(&mut self) {
        loop {
            while let Some(action) = self.core.poll_action() {
                self.core.assert_invariants();
                match action {
                    Action::Send { to, message } => {
                        for e in to.iter() {
                            let element = e.0 as usize;
                            if let (true, Some(session)) =
                                (self.elements[element].connected, self.elements[element].session)
                            {
                                let message = message.clone();
                                self.deliveries.push_back(Delivery::ToElement { element, session, message });
                            }
                        }
                    }
                    Action::Disconnect { element } => {
                        let e = &mut self.elements[element.0 as usize];
                        e.connected = false;
                        if let Some(session) = e.session.take() {
                            e.core.handle_session_closed(self.now, session);
                        }
                        self.core.handle_element_disconnected(self.now, element, "closed by host");
                    }
                    Action::Reply { token, reply } => {
                        assert!(self.replies.insert(token, reply).is_none(), "one reply per request");
                    }
                    Action::Event(event) => self.events.push(event),
                }
            }
            self.core.assert_invariants();
            for i in 0..self.elements.len() {
                self.drain_element(i);
            }
            let Some(delivery) = self.deliveries.pop_front() else { return };
            match delivery {
                Delivery::ToElement { element, session, message } => {
                    self.elements[element].core.handle_host_message(self.now, session, message);
                }
                Delivery::ToHost { element, session, message } => {
                    if let Some(&(opener, peer, _)) = self.peer_sessions.get(&session) {
                        self.elements[opener].core.handle_peer_message(self.now, peer, message);
                    } else if self.elements[element].connected && self.elements[element].session == Some(session) {
                        self.core.handle_element_message(self.now, ElementId(element as u8), message);
                    }
                }
                Delivery::Closed { element, session } => {
                    if self.elements[element].session == Some(session) {
                        self.elements[element].connected = false;
                        self.elements[element].session = None;
                        let element = ElementId(element as u8);
                        self.core.handle_element_disconnected(self.now, element, "closed by the element");
                    }
                }
            }
        }
    }

    /// Carry out what an element's core asks, as its shell would.
    fn drain_element(&mut self, i: usize) {
        while let Some(action) = self.elements[i].core.poll_action() {
            self.elements[i].core.assert_invariants();
            let now = self.now;
            match action {
                ElementAction::Send { session, message } => {
                    self.deliveries.push_back(Delivery::ToHost { element: i, session, message })
                }
                ElementAction::Close { session } => {
                    self.deliveries.push_back(Delivery::Closed { element: i, session });
                }
                ElementAction::EnsureVolumes { session, specs } => {
                    let e = &mut self.elements[i];
                    let result = specs
                        .iter()
                        .map(|spec| e.storage.ensure_volume(spec).map(|v| (v, e.storage.info(v))))
                        .collect::<Result<Vec<_>, String>>();
                    e.core.handle_volumes_ensured(now, session, result);
                }
                ElementAction::CheckVolumes { session, request_id, specs } => {
                    let e = &mut self.elements[i];
                    let result = e.storage.check_new_volumes(&specs);
                    e.core.handle_volumes_checked(now, session, request_id, result);
                }
                ElementAction::Storage(job) => {
                    let e = &mut self.elements[i];
                    let done = match job {
                        StorageJob::AdoptEpoch(epoch, host) => {
                            StorageDone::AdoptEpoch(e.storage.adopt_epoch(epoch, host))
                        }
                        StorageJob::Commit(batch) => StorageDone::Commit(e.storage.commit(&batch)),
                        StorageJob::RemoveVolumes(volumes) => {
                            StorageDone::RemoveVolumes(volumes.iter().try_for_each(|v| e.storage.remove_volume(*v)))
                        }
                        StorageJob::ResizeVolumes(volumes) => StorageDone::ResizeVolumes(
                            volumes.iter().try_for_each(|(v, size)| e.storage.resize_volume(*v, *size)),
                        ),
                    };
                    if e.responsive {
                        e.storage.sync();
                        e.core.handle_storage_done(now, done);
                    } else {
                        e.held = Some(done);
                    }
                }
                ElementAction::Serve { session, volume, request } => {
                    let message = crate::storage::serve(&self.elements[i].storage, volume, request);
                    self.deliveries.push_back(Delivery::ToHost { element: i, session, message });
                    for damaged in self.elements[i].storage.take_damaged() {
                        self.elements[i].core.handle_volume_damaged(now, damaged);
                    }
                }
                ElementAction::ConnectPeer { .. } if self.elements[i].peers_unreachable => {}
                ElementAction::ConnectPeer { peer, address, hello } => {
                    let target: usize = address[1..].parse().expect("test address e<i>");
                    let session = self.open_session(target);
                    self.peer_sessions.insert(session, (i, peer, target));
                    // The peer's Welcome comes back through `Delivery::ToHost`.
                    self.deliveries.push_back(Delivery::ToElement { element: target, session, message: hello });
                }
                ElementAction::SendPeer { peer, message } => {
                    let found = self.peer_sessions.iter().find(|(_, (o, p, _))| *o == i && *p == peer);
                    if let Some((&session, &(_, _, target))) = found {
                        self.deliveries.push_back(Delivery::ToElement { element: target, session, message });
                    }
                }
                ElementAction::ClosePeer { peer } => {
                    let found = self.peer_sessions.iter().find(|(_, (o, p, _))| *o == i && *p == peer);
                    if let Some((&session, &(_, _, target))) = found {
                        self.peer_sessions.remove(&session);
                        self.elements[target].core.handle_session_closed(now, session);
                    }
                }
                ElementAction::StartCopy { volume, session_volume, source, .. } => {
                    // The block walk is the shell's; here the source's volume is taken whole.
                    let source: usize = source[1..].parse().expect("test address e<i>");
                    let vi = volume.0 as usize;
                    let copy = self.elements[source].storage.copy_volume(vi, &self.elements[i].storage, vi);
                    let e = &mut self.elements[i];
                    let result = copy.map(|copy| {
                        e.storage.install_copy(vi, copy);
                        e.copies += 1;
                        e.storage.info(volume).applied
                    });
                    let info = e.storage.info(volume);
                    e.core.handle_copy_done(now, volume, session_volume, info, result);
                }
                ElementAction::Refused { .. } | ElementAction::Log { .. } => {}
            }
        }
    }

    /// A slow element finishes the storage job it holds.
    fn release(&mut self, i: usize) {
        let e = &mut self.elements[i];
        if let Some(done) = e.held.take() {
            e.storage.sync();
            e.core.handle_storage_done(self.now, done);
        }
        self.run();
    }

    /// Its replay log no longer holds anything it has now.
    fn truncate_log(&mut self, i: usize) {
        let e = &mut self.elements[i];
        let next = e.applied().next();
        e.storage.truncate_log_before(0, next);
    }

    fn token(&mut self) -> Token {
        self.next_token += 1;
        Token(self.next_token)
    }

    fn write(&mut self, offset_bytes: u64, fill: u8, len: usize) -> Token {
        let token = self.token();
        let op = Op::write(offset_bytes, Bytes::from(vec![fill; len]));
        self.core.handle_host_write(self.now, token, VOLUME, op);
        self.run();
        token
    }

    /// Send a read; its answer, if any, lands in `replies`.
    fn send_read(&mut self, offset_bytes: u64, len: u32) -> Token {
        let token = self.token();
        self.core.handle_host_read(self.now, token, VOLUME, offset_bytes, len);
        self.run();
        token
    }

    fn read(&mut self, offset_bytes: u64, len: u32) -> Reply {
        let token = self.send_read(offset_bytes, len);
        self.replies.remove(&token).expect("reads against responsive elements answer at once")
    }

    fn advance_ms(&mut self, ms: u64) {
        self.now = self.now.plus_ms(ms);
        self.core.handle_timeout(self.now);
        for e in &mut self.elements {
            e.core.handle_timeout(self.now);
        }
        self.run();
    }

    /// Let `ms` pass in steps, the heartbeats keeping the sessions.
    fn pass_ms(&mut self, ms: u64) {
        let step = limits::HEARTBEAT_INTERVAL_MS_DEFAULT;
        for _ in 0..ms / step {
            self.advance_ms(step);
        }
        self.advance_ms(ms % step);
    }

    fn states(&self) -> String {
        self.core.status(self.now).elements.iter().map(|e| e.state).collect::<Vec<_>>().join(",")
    }

    fn mode(&self) -> VolumeMode {
        self.core.status(self.now).volumes[0].mode
    }
}

/// Quorum arithmetic as a table: N elements, Q, how many acknowledge → answered?
#[test]
fn quorum_table() {
    fn check(n: usize, quorum: usize, responsive: usize, answered: bool) {
        let mut c = Cluster::new(n, quorum);
        for i in responsive..n {
            c.elements[i].responsive = false;
        }
        let token = c.write(0, 1, 4096);
        assert_eq!(c.replies.contains_key(&token), answered, "N={n} Q={quorum} acks={responsive}");
        if answered {
            assert_eq!(c.replies[&token], Reply::Done(Ok(())));
        }
    }
    //    N  Q  acks  answered
    check(3, 2, 3, true);
    check(3, 2, 2, true);
    check(3, 2, 1, false);
    check(3, 1, 1, true);
    check(3, 3, 2, false);
    check(1, 1, 1, true);
    check(5, 3, 2, false);
    check(5, 3, 3, true);
}

#[test]
fn one_element_down_writes_go_on_two_down_read_only_and_back() {
    let mut c = Cluster::new(3, 2);
    let t = c.write(0, 0xaa, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    c.crash(2);
    assert_eq!(c.mode(), VolumeMode::ReadWrite);
    let t = c.write(4096, 0xbb, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    c.crash(1);
    assert_eq!(c.mode(), VolumeMode::ReadOnly);
    let t = c.write(0, 0xcc, 512);
    assert_eq!(c.replies[&t], Reply::Done(Err(HostError::ReadOnly)));
    // Reads still served, and correct.
    assert_eq!(c.read(0, 4096), Reply::Read(Ok(Bytes::from(vec![0xaa; 4096]))));
    assert_eq!(c.read(4096, 512), Reply::Read(Ok(Bytes::from(vec![0xbb; 512]))));
    // Element 1 missed nothing while read-only: it rejoins in sync; element 2 missed one write,
    // still in the queue: quick recovery.
    c.connect(1);
    assert_eq!(c.mode(), VolumeMode::ReadWrite);
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert!(c
        .events
        .iter()
        .any(|e| matches!(e, Event::RecoveryStarted { kind: RecoveryKind::Quick, records: 1, source: None, .. })));
    assert_eq!(c.elements[2].data()[4096..8192], [0xbb; 4096]);
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].last_recovery.as_ref().map(|r| r.records), Some(1));
}

#[test]
fn writes_in_flight_when_quorum_is_lost_fail() {
    let mut c = Cluster::new(3, 2);
    c.elements[1].responsive = false;
    c.elements[2].responsive = false;
    let t = c.write(0, 1, 4096);
    assert!(!c.replies.contains_key(&t));
    c.crash(2);
    assert!(!c.replies.contains_key(&t), "still read-write: 0 and 1 are in sync");
    c.crash(1);
    assert_eq!(c.replies[&t], Reply::Done(Err(HostError::QuorumLost)));
}

#[test]
fn full_queue_throttles_then_fails_the_laggard() {
    let queue = limits::WRITE_QUEUE_BYTES_MIN;
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = queue);
    c.elements[2].responsive = false;
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    let t1 = c.write(0, 1, big);
    assert_eq!(c.replies[&t1], Reply::Done(Ok(())), "Q=2 reached without the slow element");
    let t2 = c.write(0, 2, big);
    assert!(!c.replies.contains_key(&t2), "queue full: the first entry awaits element 2");
    assert_eq!(c.core.status(c.now).volumes[0].writes_waiting, 1);
    c.advance_ms(limits::THROTTLE_TIMEOUT_MS_DEFAULT / 2);
    assert!(!c.replies.contains_key(&t2), "throttled, not yet failed");
    c.advance_ms(limits::THROTTLE_TIMEOUT_MS_DEFAULT);
    assert_eq!(c.replies[&t2], Reply::Done(Ok(())));
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].state, "failed");
    assert!(status.elements[2].reason.as_deref().unwrap_or("").contains("too slow"));
}

#[test]
fn a_slow_element_that_catches_up_in_time_is_kept() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN);
    c.elements[2].responsive = false;
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    c.write(0, 1, big);
    let t2 = c.write(0, 2, big);
    c.advance_ms(100);
    c.elements[2].responsive = true;
    c.release(2);
    assert_eq!(c.replies[&t2], Reply::Done(Ok(())));
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
}

#[test]
fn acknowledgement_latency_is_measured_per_element_from_the_sequence_assignment() {
    let mut c = Cluster::new(3, 2);
    c.elements[2].responsive = false;
    c.write(0, 1, 4096);
    c.advance_ms(100);
    c.elements[2].responsive = true;
    c.release(2);
    let status = c.core.status(c.now);
    let (fast, slow) = (&status.elements[0].ack_latency, &status.elements[2].ack_latency);
    assert_eq!((fast.count, fast.sum_us, fast.buckets[0]), (1, 0, 1), "acknowledged at once");
    assert_eq!((slow.count, slow.sum_us), (1, 100_000), "acknowledged 100 ms after the assignment");
    assert_eq!(slow.buckets[crate::latency::bucket_of(100_000)], 1);
    // A failure is counted by kind.
    c.crash(1);
    c.advance_ms(10_000);
    let failures = &c.core.status(c.now).elements[1].failures;
    assert!(failures.iter().any(|(kind, n)| *n >= 1 && *kind != "not_connected_yet"), "{failures:?}");
}

#[test]
fn a_slow_element_that_keeps_progressing_is_never_failed() {
    // The queue is full most of the time, but the slow element acknowledges something every
    // 500 ms: the throttle must not count time in which the queue moved.
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN);
    c.elements[2].responsive = false;
    let quarter = proto::PAYLOAD_BYTES_MAX as usize / 4;
    let mut tokens = Vec::new();
    for round in 0..20u8 {
        for _ in 0..2 {
            tokens.push(c.write(0, round, quarter));
        }
        c.advance_ms(500);
        // Element 2 finishes one group commit at a time.
        c.release(2);
        assert_eq!(c.states(), "in-sync,in-sync,in-sync", "round {round}");
    }
    assert!(c.core.status(c.now).volumes[0].writes_waiting > 0, "the queue really was full");
}

#[test]
fn reads_go_to_the_closest_element_and_see_unapplied_writes() {
    let mut c = Cluster::new(3, 2);
    c.write(0, 1, 8192);
    // Measure round trips: element 1 answers fastest.
    for (i, rtt_ms) in [(0usize, 5u64), (1, 1), (2, 9)] {
        let ping_at = c.now;
        c.core.handle_element_message(
            c.now.plus_ms(rtt_ms),
            ElementId(i as u8),
            ElementMessage::Pong { nonce: ping_at.0, epoch: Epoch(5), owner_absent_ms: 0, lease_ms: 500 },
        );
    }
    assert_eq!(c.core.closest_in_sync(), Some(ElementId(1)));
    // Element 1 stops applying; its reads must still show the newer write from the queue.
    c.elements[1].responsive = false;
    let t = c.write(512, 7, 1024);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())), "0 and 2 make the quorum");
    let mut expect = vec![1u8; 4096];
    expect[512..1536].fill(7);
    assert_eq!(c.read(0, 4096), Reply::Read(Ok(Bytes::from(expect))));
    assert_eq!(c.elements[1].data()[512], 1, "the element itself had not applied it");
}

/// Issue `count` reads of `len` bytes at once; the reads the host element sent straight away,
/// per element (they are delivered too, as the cluster would).
fn read_burst(c: &mut Cluster, count: u64, len: u32) -> (Vec<Token>, Vec<usize>) {
    let tokens: Vec<Token> = (0..count)
        .map(|i| {
            let t = c.token();
            c.core.handle_host_read(c.now, t, VOLUME, i * len as u64, len);
            t
        })
        .collect();
    let mut sent = vec![0; c.elements.len()];
    while let Some(action) = c.core.poll_action() {
        let Action::Send { to, message } = action else { panic!("only reads are sent: {action:?}") };
        assert!(matches!(message, HostMessage::Read { .. }), "only reads are sent: {message:?}");
        for e in to.iter() {
            let element = e.0 as usize;
            sent[element] += 1;
            let session = c.elements[element].session.expect("connected");
            c.deliveries.push_back(Delivery::ToElement { element, session, message: message.clone() });
        }
    }
    (tokens, sent)
}

#[test]
fn reads_out_at_an_element_stay_within_its_window_and_the_rest_follow_its_replies() {
    let mut c = Cluster::new(3, 2);
    c.write(0, 9, 4096);
    // 24 reads of 128 KiB (3 MiB): before any reply has measured the link, 1 MiB goes out.
    let (tokens, sent) = read_burst(&mut c, 24, 128 * 1024);
    assert_eq!(sent.iter().sum::<usize>(), 8, "{sent:?}");
    assert_eq!(sent.iter().filter(|n| **n > 0).count(), 1, "all to the closest element: {sent:?}");
    // `starfish status` shows the window, what is out in it, and what waits.
    let busy = sent.iter().position(|n| *n > 0).expect("one element was sent reads");
    let status = c.core.status(c.now);
    assert_eq!((status.reads_waiting, status.reads_waiting_bytes), (16, 16 * 128 * 1024));
    let e = &status.elements[busy];
    assert_eq!((e.reads_out_bytes, e.read_window_bytes, e.read_rate_bytes_per_s), (1 << 20, Some(1 << 20), None));
    assert!(status.elements.iter().enumerate().all(|(i, e)| i == busy || e.reads_out_bytes == 0));
    c.run();
    let status = c.core.status(c.now);
    assert_eq!((status.reads_waiting, status.elements[busy].reads_out_bytes), (0, 0));
    for (i, t) in tokens.iter().enumerate() {
        let Some(Reply::Read(Ok(data))) = c.replies.remove(t) else { panic!("read {i} answered") };
        assert_eq!(data[0], if i == 0 { 9 } else { 0 });
    }
    // One read larger than the window still goes out, alone.
    let (tokens, sent) = read_burst(&mut c, 2, 2 * 1024 * 1024);
    assert_eq!(sent.iter().sum::<usize>(), 1, "{sent:?}");
    c.run();
    assert!(tokens.iter().all(|t| matches!(c.replies.remove(t), Some(Reply::Read(Ok(_))))));
}

#[test]
fn reads_waiting_for_a_failed_element_go_to_another() {
    let mut c = Cluster::new(3, 2);
    let (tokens, sent) = read_burst(&mut c, 24, 128 * 1024);
    let busy = sent.iter().position(|n| *n > 0).expect("one element was sent reads");
    c.crash(busy);
    c.run();
    for t in &tokens {
        assert_eq!(c.replies.remove(t), Some(Reply::Read(Ok(Bytes::from(vec![0u8; 128 * 1024])))));
    }
}

#[test]
fn without_the_window_every_read_goes_out_at_once() {
    // The simulator's `--broken unbounded-reads`.
    let mut c = Cluster::with(3, 2, |cfg| cfg.read_window = false);
    let (_, sent) = read_burst(&mut c, 24, 128 * 1024);
    assert_eq!(sent.iter().sum::<usize>(), 24, "{sent:?}");
    let status = c.core.status(c.now);
    assert_eq!(status.reads_waiting, 0);
    assert!(status.elements.iter().all(|e| e.read_window_bytes.is_none()));
}

#[test]
fn read_cache_serves_hits_without_elements() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.read_cache_bytes = 1 << 20);
    c.write(0, 3, 4096);
    c.crash(0);
    c.crash(1);
    c.crash(2);
    // The read lease of the last pongs still runs.
    assert_eq!(c.read(0, 4096), Reply::Read(Ok(Bytes::from(vec![3u8; 4096]))), "write-through");
    assert_eq!(c.read(8192, 4096), Reply::Read(Err(HostError::Unavailable)));
    // Once it ends, not even a cache hit is answered: a newer host element may have taken
    // the elements and overwritten the block.
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    let t = c.token();
    c.core.handle_host_read(c.now, t, VOLUME, 0, 4096);
    c.run();
    assert!(!c.replies.contains_key(&t), "held while the lease is not renewed");
    c.advance_ms(limits::HEARTBEAT_TIMEOUT_MS_DEFAULT);
    assert_eq!(c.replies[&t], Reply::Read(Err(HostError::Unavailable)));
}

#[test]
fn a_read_waits_for_the_read_lease_and_a_pong_renews_it() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.read_cache_bytes = 1 << 20);
    c.write(0, 3, 4096);
    assert_eq!(c.core.lease_minimum(), 2);
    // Two elements stop answering (their connections stay open): only one lease is renewed.
    c.elements[1].connected = false;
    c.elements[2].connected = false;
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    assert!(!c.core.lease_held(c.now));
    let t = c.token();
    c.core.handle_host_read(c.now, t, VOLUME, 0, 4096);
    c.run();
    assert!(!c.replies.contains_key(&t), "a cache hit is held without the lease");
    // One of them answers again: its next pong renews the lease, and the held read is answered.
    c.elements[1].connected = true;
    c.advance_ms(limits::HEARTBEAT_INTERVAL_MS_DEFAULT);
    assert!(c.core.lease_held(c.now));
    assert_eq!(c.replies.remove(&t), Some(Reply::Read(Ok(Bytes::from(vec![3u8; 4096])))));
}

#[test]
fn flush_waits_for_earlier_writes() {
    let mut c = Cluster::new(3, 2);
    c.elements[1].responsive = false;
    c.elements[2].responsive = false;
    let w = c.write(0, 1, 4096);
    let f = c.token();
    c.core.handle_host_flush(c.now, f, VOLUME);
    c.run();
    assert!(!c.replies.contains_key(&f));
    c.elements[1].responsive = true;
    c.release(1);
    assert_eq!(c.replies[&w], Reply::Done(Ok(())));
    assert_eq!(c.replies[&f], Reply::Done(Ok(())));
}

#[test]
fn silent_element_is_failed_by_heartbeat() {
    let mut c = Cluster::new(3, 2);
    c.elements[2].connected = false; // Stops answering without the connection closing.
    c.advance_ms(limits::HEARTBEAT_TIMEOUT_MS_DEFAULT / 2);
    for i in 0..2 {
        c.core.handle_element_message(
            c.now,
            ElementId(i),
            ElementMessage::Pong { nonce: c.now.0, epoch: Epoch(5), owner_absent_ms: 0, lease_ms: 500 },
        );
    }
    c.advance_ms(limits::HEARTBEAT_TIMEOUT_MS_DEFAULT / 2 + 100);
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].state, "failed");
    assert!(status.elements[2].reason.as_deref().unwrap_or("").contains("heartbeat"));
    assert_eq!(status.elements[0].state, "in-sync");
}

/// What a host element that crashed after three 4 KiB writes leaves: its volume's log (sequence
/// 1 is its beginning, 2..=4 the writes) and its elements, each holding all of it.
fn three_writes() -> (Vec<Record>, Vec<TestElement>) {
    let mut old = Cluster::new(3, 2);
    for s in 0..3u8 {
        old.write(s as u64 * 4096, s + 1, 4096);
    }
    let history = old.elements[0].storage.log_records(LocalVolume(0), Sequence::ZERO, u64::MAX).expect("log");
    (history, std::mem::take(&mut old.elements))
}

impl TestElement {
    /// An element whose storage holds `records`.
    fn holding(id: u64, records: &[Record]) -> TestElement {
        let mut e = TestElement::new(id);
        e.install(records);
        e
    }

    /// An element holding `records` that found block 1 failing its checksum: a repair.
    fn with_a_bad_block_found(id: u64, records: &[Record]) -> TestElement {
        let mut e = TestElement::holding(id, records);
        e.storage.corrupt_blocks.insert((0, 1));
        assert!(e.storage.read(LocalVolume(0), 4096, 4096).is_err(), "the bad block is found");
        assert_eq!(e.storage.take_damaged(), vec![LocalVolume(0)]);
        e
    }
}

impl Cluster {
    /// A new host element (epoch 6) over `elements`, none of them reached yet, as after a
    /// restart of everything: `connect` boots each from its storage.
    fn over(elements: Vec<TestElement>) -> Cluster {
        let mut c = Cluster::new(3, 2);
        let mut config = c.core.config().clone();
        config.epoch = Epoch(6);
        c.core = HostCore::new(config, c.now);
        c.elements = elements;
        for e in &mut c.elements {
            e.connected = false;
            e.down = true;
        }
        c
    }
}

#[test]
fn restart_rolls_lagging_elements_forward_from_the_most_advanced() {
    // Elements left by a crashed host element at sequences 4, 3, 2 (1 is its beginning).
    let (history, mut elements) = three_writes();
    elements[1] = TestElement::holding(2, &history[..3]);
    elements[2] = TestElement::holding(3, &history[..2]);
    let mut c = Cluster::over(elements);
    for i in 0..3 {
        c.connect(i);
    }
    // A restarted element keeps the read lease it may have promised before it stopped.
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    for e in &c.elements {
        // Rolled forward to 4, then this host element's beginning.
        assert_eq!(e.applied(), Sequence(5));
        assert_eq!(e.storage.vols[0].history.last(), Some(&Epoch(6)));
        assert_eq!(e.data()[8192], 3);
    }
    let t = c.write(0, 9, 512);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    assert_eq!(c.core.status(c.now).volumes[0].last_sequence, Sequence(6));
}

/// With no element in sync, a volume that needs a copy is copied from a peer the write queue
/// streams it to, instead of failing its element for want of an in-sync peer (which left every
/// element failed for good when each needed something only another could give).
#[test]
fn with_no_element_in_sync_a_copy_comes_from_a_peer_that_holds_the_volume_current() {
    // A crashed host element left e0 at sequence 3 and e1 at 4 with a block that fails its
    // checksum (a repair); e2 was in the middle of a full recovery.
    let (history, mut elements) = three_writes();
    elements[0] = TestElement::holding(1, &history[..3]);
    elements[1] = TestElement::with_a_bad_block_found(2, &history);
    elements[2] = TestElement::holding(3, &history[..1]);
    elements[2].storage.begin_copy(0);
    let mut c = Cluster::over(elements);
    // Each restarted element keeps the read lease it may have promised before it stopped.
    c.connect(0);
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    assert!(c.core.elements[0].welcome.is_some(), "e0 welcomed");
    // Now e0 cannot finish a commit: it stays behind, so no element is in sync.
    c.elements[0].responsive = false;
    c.connect(1);
    c.connect(2);
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    // e1 continued the volume (sequence 4) but needs its blocks copied; e2 needs a copy; the
    // only peer that holds the volume intact on the current history is e0, in quick recovery.
    assert_eq!(c.elements[1].copies, 1, "{:?}", c.core.status(c.now).elements[1]);
    assert!(c.events.iter().any(|e| matches!(e, Event::RecoveryProgress { element: ElementId(1), message }
            if message.contains("from e0 (not in sync"))));
    c.elements[0].responsive = true;
    c.release(0);
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    for e in &c.elements {
        assert_eq!(e.data(), c.elements[0].data());
        assert_eq!(e.data()[4096], 2);
    }
    let t = c.write(0, 9, 512);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
}

/// With no element in sync and no peer that holds the volume, a volume that needs a copy waits,
/// its element connected and recovering (status says which volume), and is copied once a peer
/// is in sync.
#[test]
fn a_copy_no_peer_can_serve_waits_until_one_can() {
    // e0 holds a record of an older host element that never reached the others (diverged);
    // e1 continues the volume but has a block that fails its checksum; e2 was being copied.
    let (history, mut elements) = three_writes();
    let stray = Record {
        volume: VOLUME,
        epoch: Epoch(3),
        sequence: Sequence(1),
        op: Op::write(8192, Bytes::from(vec![9u8; 4096])),
    };
    elements[0] = TestElement::holding(1, &[stray]);
    elements[1] = TestElement::with_a_bad_block_found(2, &history);
    elements[2] = TestElement::new(3);
    elements[2].storage.begin_copy(0);
    let mut c = Cluster::over(elements);
    for i in 0..3 {
        c.connect(i);
    }
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    let status = c.core.status(c.now);
    for e in &status.elements {
        assert_eq!(e.state, "recovering", "{e:?}");
        assert_eq!(e.recovery.as_ref().map(|r| r.waiting_for_source.clone()), Some(vec!["vol0".to_string()]));
    }
    assert!(c.elements.iter().all(|e| e.copies == 0));
    assert_eq!(c.mode(), VolumeMode::ReadOnly);
    // e1's disk is replaced by one that holds the same history intact: the others copy from it.
    c.crash(1);
    c.elements[1] = TestElement::holding(2, &history);
    c.elements[1].down = true;
    c.connect(1);
    c.advance_ms(limits::LEASE_MS_DEFAULT);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!((c.elements[0].copies, c.elements[2].copies), (1, 1));
    for e in &c.elements {
        assert_eq!(e.data(), c.elements[1].data());
    }
}

#[test]
fn element_from_a_newer_epoch_fences_us() {
    let mut c = Cluster::new(3, 2);
    c.crash(0);
    c.elements[0].connected = true;
    c.core.handle_element_connected(c.now, ElementId(0));
    while c.core.poll_action().is_some() {}
    c.core.handle_element_message(
        c.now,
        ElementId(0),
        ElementMessage::Welcome {
            epoch: Epoch(99),
            element_id: 1,
            volumes: vec![VolumeState {
                applied_sequence: Sequence::ZERO,
                applied_epoch: Epoch(0),
                copying: false,
                repair: false,
                size_bytes: 0,
            }],
        },
    );
    c.run();
    let status = c.core.status(c.now);
    assert!(status.elements[0].reason.as_deref().unwrap_or("").contains("fenced"));
}

#[test]
fn an_element_behind_the_write_queue_replays_from_a_peer() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN);
    c.crash(2);
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    for i in 0..4u8 {
        c.write(0, i + 1, big);
    }
    c.connect(2);
    assert!(c
        .events
        .iter()
        .any(|e| matches!(e, Event::RecoveryStarted { kind: RecoveryKind::Replay, records: 4, source: Some(_), .. })));
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(c.elements[2].data(), c.elements[0].data());
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].last_recovery.as_ref().map(|r| r.kind), Some(RecoveryKind::Replay));
}

#[test]
fn replay_tries_every_peer_then_copies_blocks() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN);
    c.crash(2);
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    for i in 0..4u8 {
        c.write(0, i + 1, big);
    }
    // The first peer asked cannot serve; the other can.
    c.truncate_log(1);
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync", "fell back to the other peer");
    assert_eq!(c.elements[2].copies, 0);
    // Next time neither can: it copies blocks from a peer, then follows the write queue.
    c.crash(2);
    for i in 0..4u8 {
        c.write(0, i + 1, big);
    }
    c.truncate_log(0);
    c.truncate_log(1);
    c.connect(2);
    assert_eq!(c.elements[2].copies, 1);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].last_recovery.as_ref().map(|r| r.kind), Some(RecoveryKind::Full));
    assert_eq!(c.elements[2].data(), c.elements[0].data());
    c.write(0, 9, 4096);
    assert_eq!(c.elements[2].data(), c.elements[0].data(), "in the quorum again");
}

#[test]
fn a_diverged_or_copy_interrupted_element_is_copied_not_failed() {
    let mut c = Cluster::new(3, 2);
    c.crash(2);
    // It holds a record of an older host element that never reached the others: at sequence 1,
    // where this host element began.
    let stray = Record {
        volume: VOLUME,
        epoch: Epoch(3),
        sequence: Sequence(1),
        op: Op::write(8192, Bytes::from(vec![9u8; 4096])),
    };
    c.elements[2] = TestElement::new(3);
    c.elements[2].install(std::slice::from_ref(&stray));
    c.write(0, 1, 4096);
    c.write(0, 2, 4096);
    c.write(4096, 3, 4096);
    c.connect(2);
    // A restarted element keeps the read lease it may have promised before it stopped.
    c.pass_ms(limits::LEASE_MS_DEFAULT);
    assert_eq!(c.elements[2].copies, 1, "a diverged history is copied over");
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(c.elements[2].data(), c.elements[0].data());
}

#[test]
fn a_replaying_element_does_not_hold_the_write_queue() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN);
    c.crash(2);
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    for i in 0..4u8 {
        c.write(0, i, big);
    }
    // Element 2 comes back, but its replay stalls: it cannot reach its peers.
    c.elements[2].peers_unreachable = true;
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,recovering");
    // Writes keep flowing and the queue keeps evicting without waiting for element 2.
    for i in 0..4u8 {
        let t = c.write(0, i, big);
        assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    }
    for _ in 0..10 {
        c.advance_ms(limits::THROTTLE_TIMEOUT_MS_DEFAULT / 4);
    }
    let status = c.core.status(c.now);
    assert_eq!(c.states(), "in-sync,in-sync,recovering", "not failed by the throttle: {:?}", status.elements[2].reason);
}

#[test]
fn diverged_or_too_far_behind_elements_stay_out() {
    let mut c = Cluster::with(3, 2, |cfg| {
        cfg.write_queue_bytes = limits::WRITE_QUEUE_BYTES_MIN;
        cfg.element_addresses.clear();
    });
    c.crash(2);
    let big = proto::PAYLOAD_BYTES_MAX as usize / 2;
    for i in 0..4u8 {
        c.write(0, i, big);
    }
    c.connect(2);
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].state, "failed");
    assert!(status.elements[2].reason.as_deref().unwrap_or("").contains("no in-sync peer to replay them from"));
    assert_eq!(c.mode(), VolumeMode::ReadWrite);
}

#[test]
fn block_status_marks_queued_writes_as_data() {
    let extents = vec![BlockExtent { length_bytes: 16384, allocated: false }];
    let mut q = WriteQueue::new(1 << 30, Sequence::ZERO, Epoch(0));
    q.push(Entry {
        record: Record {
            volume: VOLUME,
            epoch: Epoch(1),
            sequence: Sequence(1),
            op: Op::write(4096, Bytes::from(vec![1; 4096])),
        },
        acked_by: ElementSet::default(),
        weak_by: ElementSet::default(),
        host_reply: HostReply::Done,
        assigned_at: None,
    });
    let got = overlay_extents(&q, Sequence::ZERO, 0, 16384, extents.clone());
    assert_eq!(
        got,
        vec![
            BlockExtent { length_bytes: 4096, allocated: false },
            BlockExtent { length_bytes: 4096, allocated: true },
            BlockExtent { length_bytes: 8192, allocated: false },
        ]
    );
    assert_eq!(
        overlay_extents(&q, Sequence(1), 0, 16384, extents),
        vec![BlockExtent { length_bytes: 16384, allocated: false }]
    );
}

#[test]
fn a_heartbeat_failure_is_reported_once_while_the_session_closes() {
    let mut c = Cluster::new(3, 2);
    // The shell is slow to close the session: timeouts keep coming meanwhile.
    c.core.handle_element_message(
        c.now,
        ElementId(2),
        ElementMessage::Pong { nonce: 0, epoch: Epoch(5), owner_absent_ms: 0, lease_ms: 500 },
    );
    for _ in 0..20 {
        c.now = Time(c.now.0 + 1_000_000);
        c.core.handle_timeout(c.now);
        while let Some(action) = c.core.poll_action() {
            if let Action::Event(event) = action {
                c.events.push(event);
            }
        }
    }
    let failures = c
        .events
        .iter()
        .filter(|e| matches!(e, Event::ElementFailed { element, .. } if *element == ElementId(2)))
        .count();
    assert_eq!(failures, 1, "a silent element fails once per session, not at every timeout");
}

// ----- epochs, start-up, identity --------------------------------------------------------------

impl Cluster {
    /// The host element is replaced by a new one (the old one is gone) with this first epoch
    /// offer and identity; it connects to `reachable`.
    fn new_host(&mut self, first_epoch: u64, host_id: u64, reachable: &[usize]) {
        let mut config = self.core.config().clone();
        config.epoch = Epoch(first_epoch);
        config.host_id = HostId(host_id);
        // The old one's read lease runs out before the new one gets any element.
        self.now = self.now.plus_ms(limits::LEASE_MS_DEFAULT);
        self.core = HostCore::new(config, self.now);
        self.events.clear();
        for e in &mut self.elements {
            if let Some(session) = e.session.take() {
                e.core.handle_session_closed(self.now, session);
            }
            e.connected = false;
        }
        self.reconnect(reachable);
    }

    /// What the shell's reconnect loop does: every element in `reachable` without a session
    /// gets a new one, until none is closed any more (a raised epoch closes them all).
    fn reconnect(&mut self, reachable: &[usize]) {
        for _ in 0..4 {
            let closed: Vec<usize> = reachable.iter().copied().filter(|&i| !self.elements[i].connected).collect();
            if closed.is_empty() {
                return;
            }
            for i in closed {
                self.connect(i);
            }
        }
    }
}

#[test]
fn a_new_host_element_takes_an_epoch_above_what_the_elements_follow() {
    // Whatever the new host element offers first (as if from a clock far behind, equal to
    // the old one's, or far ahead), it ends above the old epoch, alone in its own, and keeps
    // the old history.
    for first in [1u64, 5, 1_000_000] {
        let mut c = Cluster::new(3, 2); // epoch 5, host element 1
        let t = c.write(0, 7, 4096);
        assert_eq!(c.replies[&t], Reply::Done(Ok(())));
        c.new_host(first, 2, &[0, 1, 2]);
        let expected = if first > 5 { Epoch(first) } else { Epoch(6) };
        assert_eq!(c.core.epoch(), expected, "first offer {first}");
        let raised = c.events.iter().any(|e| matches!(e, Event::EpochRaised { to, .. } if *to == Epoch(6)));
        assert_eq!(raised, first <= 5, "first offer {first}: {:?}", c.events);
        assert_eq!(c.states(), "in-sync,in-sync,in-sync", "first offer {first}");
        for e in &c.elements {
            assert_eq!((e.core.epoch(), e.storage.holder), (expected, HostId(2)));
        }
        assert_eq!(c.read(0, 4096), Reply::Read(Ok(Bytes::from(vec![7; 4096]))));
        let t = c.write(4096, 8, 4096);
        assert_eq!(c.replies[&t], Reply::Done(Ok(())), "first offer {first}");
    }
}

#[test]
fn a_host_element_starts_with_a_majority_not_just_a_quorum() {
    // N=4, Q=2: two elements are a write quorum but not a majority. Two host elements that
    // started from disjoint pairs could each have written without seeing the other's epoch.
    let mut c = Cluster::new(4, 2);
    c.new_host(1, 2, &[0, 1]);
    for _ in 0..8 {
        c.advance_ms(limits::STARTUP_GRACE_MS_DEFAULT / 7); // heartbeats keep the sessions
    }
    assert_eq!(c.states(), "failed,failed,failed,failed", "not admitted before it is ready");
    assert_eq!(c.mode(), VolumeMode::Starting);
    assert!(!c.core.status(c.now).ready);
    c.reconnect(&[2]);
    assert!(c.core.status(c.now).ready, "{:?} {:?}", c.core.status(c.now), c.events);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync,failed");
    assert_eq!(c.mode(), VolumeMode::ReadWrite);
}

#[test]
fn requests_are_held_only_for_the_startup_timeout() {
    let mut c = Cluster::new(3, 2);
    c.new_host(1, 2, &[]);
    let held = c.token();
    c.core.handle_host_read(c.now, held, VOLUME, 0, 4096);
    c.advance_ms(limits::STARTUP_GRACE_MS_DEFAULT + 1);
    assert!(!c.replies.contains_key(&held), "held through the grace period");
    assert_eq!(c.mode(), VolumeMode::Starting);
    c.advance_ms(limits::STARTUP_TIMEOUT_MS_DEFAULT);
    assert_eq!(c.replies.remove(&held), Some(Reply::Read(Err(HostError::Unavailable))));
    assert_eq!(c.mode(), VolumeMode::Unavailable);
    assert!(c.events.iter().any(|e| matches!(e, Event::StartupTimedOut { welcomed: 0, .. })));
    // Later requests fail at once, until the elements answer.
    let t = c.write(0, 1, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Err(HostError::Unavailable)));
    c.reconnect(&[0, 1, 2]);
    assert_eq!(c.mode(), VolumeMode::ReadWrite);
    let t = c.write(0, 2, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
}

#[test]
fn the_same_element_under_two_names_counts_once() {
    let mut c = Cluster::new(3, 2);
    // e2's address now leads to e1's disk: same identity.
    c.crash(2);
    c.elements[2].id = c.elements[1].id;
    c.connect(2);
    let status = c.core.status(c.now);
    assert_eq!(status.elements[2].failure, Some(Failure::SameElementAs("e1".into())), "{status:?}");
    assert_eq!(c.states(), "in-sync,in-sync,failed");
    // e1 reconnecting is still itself.
    c.crash(1);
    c.connect(1);
    assert_eq!(c.states(), "in-sync,in-sync,failed");
}

#[test]
fn two_elements_at_one_address_are_refused_by_validation() {
    let mut config = HostConfig::new(
        Epoch(1),
        2,
        vec!["a".into(), "b".into(), "c".into()],
        vec![VolumeSpec { name: "v".into(), size_bytes: 1 << 20, clone_of: None, at_least: false }],
    );
    config.element_addresses = vec!["127.0.0.1:1".into(), "127.0.0.1:2".into(), "127.0.0.1:1".into()];
    let error = config.validate().expect_err("duplicate address");
    assert!(error.contains("elements a and c have the same address 127.0.0.1:1"), "{error}");
}

#[test]
fn the_configured_volumes_leave_room_for_the_catalog() {
    let volumes = |n: usize| -> Vec<VolumeSpec> {
        (0..n)
            .map(|i| VolumeSpec { name: format!("v{i}"), size_bytes: 1 << 20, clone_of: None, at_least: false })
            .collect()
    };
    let config = |volumes| HostConfig::new(Epoch(1), 2, vec!["a".into(), "b".into(), "c".into()], volumes);
    let most = limits::VOLUMES_MAX - 1;
    config(volumes(most)).validate().expect("as many volumes as leave the catalog room");
    let error = config(volumes(most + 1)).validate().expect_err("no room for the catalog");
    assert!(error.contains(&format!("need 1 to {most} volumes")) && error.contains("catalog"), "{error}");
    // The host element adds the catalog, not exported, as the shell's `start_active` does:
    // valid, and a core starts on it.
    let mut full = config(volumes(most));
    full.exports = full.exported();
    full.volumes.push(VolumeSpec {
        name: crate::catalog::CATALOG_VOLUME.into(),
        size_bytes: crate::catalog::CATALOG_VOLUME_BYTES,
        clone_of: None,
        at_least: false,
    });
    full.validate().expect("the operator's volumes and the catalog");
    HostCore::new(full, Time(0));
    assert!(config(Vec::new()).validate().is_err(), "no volume at all");
}

#[test]
fn a_running_host_element_takes_back_an_element_whose_epoch_owner_is_gone() {
    // e2 took epoch 9 from a host element that then died before it was ready (it never
    // became ready, so it wrote nothing). The running host element (epoch 5) is refused by e2
    // at first: its owner might be alive. Once e2 says its owner has been gone for two
    // heartbeat timeouts while e0 and e1 still follow epoch 5, it starts over above 9.
    let mut c = Cluster::new(3, 2);
    let t = c.write(0, 3, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    c.crash(2);
    c.connect(2); // boots e2 again, and the host element's session to it
    let stranger = c.open_session(2);
    c.elements[2].core.handle_host_message(
        c.now,
        stranger,
        HostMessage::Hello {
            epoch: Epoch(9),
            host: HostId(77),
            volumes: vec![VolumeSpec { name: "vol0".into(), size_bytes: SIZE, clone_of: None, at_least: false }],
            admin: String::new(),
            receipt_acks: false,
        },
    );
    c.run();
    // e2 welcomes it once the read lease it promised us ran out; the host element learns it
    // from e2's next pong.
    for _ in 0..7 {
        c.advance_ms(limits::HEARTBEAT_INTERVAL_MS_DEFAULT);
    }
    c.elements[2].core.handle_session_closed(c.now, stranger);
    assert_eq!(c.states(), "in-sync,in-sync,failed");
    assert!(matches!(c.core.status(c.now).elements[2].failure, Some(Failure::Fenced { .. })));
    assert!(!c.events.iter().any(|e| matches!(e, Event::Restarted { .. })), "not while the owner may live");
    // Heartbeats keep e0 and e1 confirming epoch 5; e2 is dialled again now and then.
    for _ in 0..80 {
        c.advance_ms(limits::HEARTBEAT_INTERVAL_MS_DEFAULT);
        c.reconnect(&[2]);
    }
    assert!(c.events.iter().any(|e| matches!(e, Event::Restarted { to: Epoch(10), .. })), "{:?}", c.events);
    c.reconnect(&[0, 1, 2]);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(c.core.epoch(), Epoch(10));
    assert_eq!(c.read(0, 4096), Reply::Read(Ok(Bytes::from(vec![3; 4096]))));
}

#[test]
fn a_host_element_taken_over_by_a_majority_serves_nothing() {
    let mut c = Cluster::new(3, 2);
    let t = c.write(0, 3, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    // A newer host element (epoch 8) takes e0 and e1; its sessions stay open.
    for i in 0..2 {
        let session = c.open_session(i);
        c.elements[i].core.handle_host_message(
            c.now,
            session,
            HostMessage::Hello {
                epoch: Epoch(8),
                host: HostId(42),
                volumes: vec![VolumeSpec { name: "vol0".into(), size_bytes: SIZE, clone_of: None, at_least: false }],
                admin: String::new(),
                receipt_acks: false,
            },
        );
        c.run();
    }
    // They welcome it once the read lease they promised us runs out (no more promises
    // meanwhile), and our pings learn it.
    for _ in 0..8 {
        c.advance_ms(limits::HEARTBEAT_INTERVAL_MS_DEFAULT);
    }
    assert!(c.events.iter().any(|e| matches!(e, Event::Superseded { seen: Epoch(8), .. })), "{:?}", c.events);
    assert_eq!(c.mode(), VolumeMode::Unavailable);
    let t = c.token();
    c.core.handle_host_read(c.now, t, VOLUME, 0, 4096);
    c.run();
    assert_eq!(c.replies.remove(&t), Some(Reply::Read(Err(HostError::Unavailable))));
    let t = c.write(0, 4, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Err(HostError::Unavailable)));
}

#[test]
fn a_scrub_repairs_the_one_replica_that_differs() {
    let mut c = Cluster::new(3, 2);
    for i in 0..8u64 {
        c.write(i * 4096, i as u8 + 1, 4096);
    }
    // Block 3 of e1 changes behind its back, checksum and all: only a comparison finds it.
    c.elements[1].storage.diverge_block(0, 3);
    c.core.start_scrub(c.now, VOLUME, 0).expect("a scrub starts");
    assert!(c.core.start_scrub(c.now, VOLUME, 0).is_err(), "one scrub of a volume at a time");
    c.run();
    assert!(
        c.events.iter().any(|e| matches!(
            e,
            Event::ElementFailed {
                element: ElementId(1),
                reason: Failure::ScrubMismatch { blocks: 1, first_block: 3, .. }
            }
        )),
        "{:?}",
        c.events
    );
    let status = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("a scrub ran");
    assert!(!status.running);
    assert_eq!(status.done_bytes, SIZE);
    assert_eq!(status.findings.blocks_mismatched, 1);
    assert_eq!(status.findings.repaired, vec!["e1".to_string()]);
    assert_eq!(status.findings.blocks_compared, SIZE / BLOCK_BYTES - 1);
    assert!(c.events.iter().any(|e| matches!(e, Event::ScrubDone { .. })));
    // Back, it is repaired by a full recovery from a peer that agrees with the majority.
    c.connect(1);
    assert_eq!(c.elements[1].copies, 1);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(c.elements[1].data(), c.elements[0].data());
    c.core.start_scrub(c.now, VOLUME, 0).expect("a second scrub starts");
    c.run();
    let status = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("a scrub ran");
    assert_eq!((status.findings.blocks_mismatched, status.findings.blocks_compared), (0, SIZE / BLOCK_BYTES));
}

#[test]
fn a_scrub_with_two_replicas_that_differ_repairs_nothing_and_says_so() {
    let mut c = Cluster::new(2, 1);
    c.write(0, 1, 8192);
    c.elements[0].storage.diverge_block(0, 1);
    c.core.start_scrub(c.now, VOLUME, 0).expect("a scrub starts");
    c.run();
    let status = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("a scrub ran");
    assert_eq!((status.findings.blocks_undecided, status.findings.blocks_mismatched), (1, 0));
    assert!(status.findings.repaired.is_empty());
    assert_eq!(c.states(), "in-sync,in-sync");
}

#[test]
fn a_rotten_block_found_by_a_scrub_is_repaired_by_its_element() {
    let mut c = Cluster::new(3, 2);
    c.write(0, 1, 16384);
    c.elements[2].storage.corrupt_blocks.insert((0, 2));
    c.core.start_scrub(c.now, VOLUME, 0).expect("a scrub starts");
    c.run();
    let status = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("a scrub ran");
    assert!(status.findings.element_errors >= 1, "{status:?}");
    assert!(status.findings.last_error.as_deref().is_some_and(|e| e.contains("checksum")), "{status:?}");
    // Its element made the volume a repair and faulted: back, a full recovery repairs it.
    if c.elements[2].session.is_none() {
        c.connect(2);
    }
    assert_eq!(c.elements[2].copies, 1);
    assert_eq!(c.elements[2].data(), c.elements[0].data());
}

#[test]
fn a_read_whose_data_fails_its_checksums_goes_elsewhere_and_its_blocks_are_scrubbed() {
    let mut c = Cluster::new(3, 2);
    c.write(8192, 7, 8192);
    let token = c.token();
    c.core.handle_host_read(c.now, token, VOLUME, 8192, 8192);
    let mut asked = None;
    while let Some(action) = c.core.poll_action() {
        match action {
            Action::Send { to, message: HostMessage::Read { request_id, .. } } => {
                asked = Some((to.iter().next().expect("one element"), request_id))
            }
            other => panic!("only the read is sent: {other:?}"),
        }
    }
    let (element, request_id) = asked.expect("the read went to an element");
    // Its answer was damaged after the element checked it: one bit of the second block.
    let good = vec![7u8; 8192];
    let mut bad = good.clone();
    bad[5000] ^= 4;
    let crcs = proto::pieces::piece_crcs(8192, &good);
    let reply = ElementMessage::ReadReply {
        request_id,
        applied_sequence: Sequence(1),
        result: Ok(ReadData { data: Bytes::from(bad), crcs }),
    };
    c.core.handle_element_message(c.now, element, reply);
    c.run();
    match c.replies.remove(&token) {
        Some(Reply::Read(Ok(data))) => assert_eq!(&data[..], &good[..], "the host gets what it wrote"),
        other => panic!("the read is answered by another element: {other:?}"),
    }
    assert!(c.events.iter().any(|e| matches!(e, Event::ElementFailed { reason: Failure::ReadChecksum(_), .. })));
    let status = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("its blocks were scrubbed");
    assert_eq!((status.reason, status.total_bytes, status.running), (ScrubReason::ReadChecksum, 8192, false));
    assert_eq!(status.findings.blocks_mismatched, 0, "what is stored agrees");
}

#[test]
fn an_element_that_claims_the_last_epoch_is_failed_not_followed() {
    // A running host element: the claim is a newer epoch than ours, whose owner is not gone.
    let mut c = Cluster::new(3, 2);
    c.crash(2);
    c.elements[2].storage.epoch = Epoch(u64::MAX);
    c.connect(2);
    c.advance_ms(100);
    let status = c.core.status(c.now);
    assert_eq!((status.elements[2].state, status.epoch), ("failed", Epoch(5)));
    let token = c.write(0, 7, 4096);
    assert_eq!(c.replies.remove(&token), Some(Reply::Done(Ok(()))), "the others go on");
    // A starting host element that hears it first would raise its epoch above the claim:
    // there is nothing above.
    c.new_host(1, 2, &[2, 0, 1]);
    c.advance_ms(100);
    assert!(
        c.events.iter().any(|e| matches!(
            e,
            Event::ElementFailed { element: ElementId(2), reason: Failure::Protocol(why) } if why.contains("the last there is")
        )),
        "{:?}",
        c.events
    );
    assert!(c.core.status(c.now).epoch < Epoch(u64::MAX));
}

// ----- ack policies -----------------------------------------------------------------------------

impl Cluster {
    fn flush(&mut self) -> Token {
        let token = self.token();
        self.core.handle_host_flush(self.now, token, VOLUME);
        self.run();
        token
    }
}

/// Bug 7 in docs/testing.md: a write acknowledged under a weaker ack policy, which a start
/// did without, came back at a later start that chose its holder's longer history of an older
/// epoch; reads had gone back in time, then went forward again.
#[test]
fn a_write_a_start_did_without_does_not_come_back_at_a_later_start() {
    for begin_records in [true, false] {
        // e1 counts on receipt (`received`).
        let policies = [AckPolicy::Durable, AckPolicy::Received, AckPolicy::Durable];
        let mut c = Cluster::with(3, 2, |cfg| {
            cfg.ack_policies = policies.to_vec();
            cfg.begin_records = begin_records;
        });
        let first = c.write(0, 1, 4096);
        assert_eq!(c.replies[&first], Reply::Done(Ok(())));
        c.crash(2);
        c.elements[1].responsive = false;
        let weak = c.write(0, 2, 4096);
        assert_eq!(c.replies[&weak], Reply::Done(Ok(())), "stored by e0, received by e1");
        // e0 stops, holding it; e1 loses what it had in memory; the host element goes.
        c.crash(0);
        c.power_loss(1);
        c.elements[1].responsive = true;
        // A start with e1 and e2 does without the write, as the weaker promise allows.
        c.new_host(6, 2, &[1, 2]);
        c.pass_ms(limits::STARTUP_GRACE_MS_DEFAULT + 1);
        assert_eq!(c.read(0, 1), Reply::Read(Ok(Bytes::from(vec![1u8]))), "begin records {begin_records}");
        // A later start, with e0 back and e2.
        c.new_host(7, 3, &[0, 2]);
        c.pass_ms(limits::STARTUP_GRACE_MS_DEFAULT + 1);
        // e0 was admitted before e2 was in sync, with no peer to copy from: it comes again.
        c.reconnect(&[0]);
        let later = c.read(0, 1);
        if begin_records {
            assert_eq!(later, Reply::Read(Ok(Bytes::from(vec![1u8]))), "the write stays out");
            assert_eq!(c.elements[0].copies, 1, "e0's longer history of an older epoch is diverged");
            assert_eq!(c.elements[0].data(), c.elements[2].data());
        } else {
            // Without beginnings it came back: what the test above catches.
            assert_eq!(later, Reply::Read(Ok(Bytes::from(vec![2u8]))));
        }
    }
}

/// A new host element with e0 and e1, whose storage holds its jobs until `release`: its
/// beginning records are sent, not yet stored.
fn started_with_beginning_unstored(policies: [AckPolicy; 3]) -> Cluster {
    let mut c = Cluster::with(3, 2, |cfg| cfg.ack_policies = policies.to_vec());
    let t = c.write(0, 1, 4096);
    assert_eq!(c.replies[&t], Reply::Done(Ok(())));
    c.crash(2);
    c.new_host(6, 2, &[0, 1]);
    c.elements[0].responsive = false;
    c.elements[1].responsive = false;
    c.pass_ms(limits::STARTUP_GRACE_MS_DEFAULT + 1);
    assert_eq!(c.core.status(c.now).volumes[0].last_sequence, Sequence(3), "its beginning follows 2");
    c
}

#[test]
fn with_weaker_ack_policies_reads_wait_until_q_elements_hold_the_beginning() {
    let mut c = started_with_beginning_unstored([AckPolicy::Durable, AckPolicy::Received, AckPolicy::Durable]);
    let token = c.send_read(0, 1);
    assert!(!c.replies.contains_key(&token), "e1's receipt is not a durable copy");
    let waiting = BeginningStatus { sequence: Sequence(3), held_by: 0, reads_wait: true, reads_held: 1 };
    assert_eq!(c.core.status(c.now).volumes[0].beginning, Some(waiting), "the status says what reads wait for");
    c.release(0);
    assert!(!c.replies.contains_key(&token), "one durable copy is not Q");
    assert_eq!(c.core.status(c.now).volumes[0].beginning, Some(BeginningStatus { held_by: 1, ..waiting }));
    c.release(1);
    assert_eq!(c.replies.remove(&token), Some(Reply::Read(Ok(Bytes::from(vec![1u8])))));
    assert!(!c.events.iter().any(|e| matches!(e, Event::BeginNotHeld { .. })));
    assert_eq!(c.core.status(c.now).volumes[0].beginning, None, "held by Q: nothing to show");
}

#[test]
fn held_reads_are_served_with_a_warning_after_the_start_up_timeout() {
    let mut c = started_with_beginning_unstored([AckPolicy::Durable, AckPolicy::Received, AckPolicy::Durable]);
    let token = c.send_read(0, 1);
    c.release(0);
    c.pass_ms(limits::STARTUP_TIMEOUT_MS_DEFAULT / 2);
    assert!(!c.replies.contains_key(&token));
    c.pass_ms(limits::STARTUP_TIMEOUT_MS_DEFAULT / 2);
    assert_eq!(c.replies.remove(&token), Some(Reply::Read(Ok(Bytes::from(vec![1u8])))));
    let warned: Vec<&Event> = c.events.iter().filter(|e| matches!(e, Event::BeginNotHeld { .. })).collect();
    assert_eq!(
        warned,
        [&Event::BeginNotHeld { volume: VOLUME, sequence: Sequence(3), held: 1, reads: 1 }],
        "told once, with what was held"
    );
    // The status keeps showing it, with reads served, until Q hold it.
    let overdue = BeginningStatus { sequence: Sequence(3), held_by: 1, reads_wait: false, reads_held: 0 };
    assert_eq!(c.core.status(c.now).volumes[0].beginning, Some(overdue));
    let later = c.send_read(0, 1);
    assert_eq!(c.replies.remove(&later), Some(Reply::Read(Ok(Bytes::from(vec![1u8])))), "not held any more");
    c.release(1);
    assert_eq!(c.core.status(c.now).volumes[0].beginning, None);
    assert_eq!(c.events.iter().filter(|e| matches!(e, Event::BeginNotHeld { .. })).count(), 1, "told once");
}

#[test]
fn with_durable_ack_policies_reads_do_not_wait_for_the_beginning() {
    // Every acknowledged write is on every start-up set: nothing a start did without was
    // acknowledged, so nothing a read could miss comes back.
    let mut c = started_with_beginning_unstored([AckPolicy::Durable; 3]);
    let token = c.send_read(0, 1);
    assert_eq!(c.replies.remove(&token), Some(Reply::Read(Ok(Bytes::from(vec![1u8])))));
    assert_eq!(c.core.status(c.now).volumes[0].beginning, None, "nothing waits for it");
}

#[test]
fn a_received_element_counts_once_the_write_is_in_its_memory_and_a_flush_waits_for_durable() {
    let policies = [AckPolicy::Durable, AckPolicy::Received, AckPolicy::Durable];
    let mut c = Cluster::with(3, 2, |cfg| cfg.ack_policies = policies.to_vec());
    // e1 holds the write in memory only; e2 not even that: e0 (durable) and e1 (received).
    c.elements[1].responsive = false;
    c.elements[2].responsive = false;
    let write = c.write(0, 1, 4096);
    assert_eq!(c.replies.remove(&write), Some(Reply::Done(Ok(()))), "received counts toward Q");
    let flush = c.flush();
    assert!(!c.replies.contains_key(&flush), "a flush waits until Q elements hold it durably");
    c.elements[1].responsive = true;
    c.release(1);
    assert_eq!(c.replies.remove(&flush), Some(Reply::Done(Ok(()))));
    assert_eq!(c.core.status(c.now).elements[1].ack_policy, AckPolicy::Received);
    // With durable elements only, the same write waits.
    let mut d = Cluster::new(3, 2);
    d.elements[1].responsive = false;
    d.elements[2].responsive = false;
    let write = d.write(0, 1, 4096);
    assert!(!d.replies.contains_key(&write));
}

#[test]
fn a_received_element_that_fails_stops_counting_what_it_had_only_in_memory() {
    let policies = [AckPolicy::Durable, AckPolicy::Received, AckPolicy::Durable];
    let mut c = Cluster::with(3, 2, |cfg| cfg.ack_policies = policies.to_vec());
    c.elements[0].responsive = false;
    c.elements[1].responsive = false;
    c.elements[2].responsive = false;
    let write = c.write(0, 1, 4096);
    assert!(!c.replies.contains_key(&write), "e1's receipt alone is not a quorum");
    c.crash(1);
    c.elements[0].responsive = true;
    c.release(0);
    assert!(!c.replies.contains_key(&write), "e1 failed: what it had in memory no longer counts");
    c.elements[2].responsive = true;
    c.release(2);
    assert_eq!(c.replies.remove(&write), Some(Reply::Done(Ok(()))));
}

#[test]
fn a_network_sync_element_counts_once_the_shell_has_put_the_write_on_the_wire() {
    let policies = [AckPolicy::Durable, AckPolicy::Durable, AckPolicy::NetworkSync];
    let mut c = Cluster::with(3, 2, |cfg| cfg.ack_policies = policies.to_vec());
    c.elements[1].responsive = false;
    c.elements[2].responsive = false;
    let write = c.write(0, 1, 4096);
    assert!(!c.replies.contains_key(&write));
    // Sequence 1 is the host element's beginning.
    c.core.handle_element_sent(c.now, ElementId(2), VOLUME, Sequence(2));
    c.run();
    assert_eq!(c.replies.remove(&write), Some(Reply::Done(Ok(()))));
    // The word of a durable element's socket counts for nothing.
    let second = c.write(4096, 2, 4096);
    c.core.handle_element_sent(c.now, ElementId(1), VOLUME, Sequence(3));
    c.run();
    assert!(!c.replies.contains_key(&second));
}

#[test]
fn a_local_sync_element_never_counts_toward_the_quorum() {
    let policies = [AckPolicy::Durable, AckPolicy::Durable, AckPolicy::LocalSync];
    let mut c = Cluster::with(3, 2, |cfg| cfg.ack_policies = policies.to_vec());
    c.elements[1].responsive = false;
    let write = c.write(0, 1, 4096);
    assert!(!c.replies.contains_key(&write), "e0 and the local-sync e2 are not a quorum");
    c.elements[1].responsive = true;
    c.release(1);
    assert_eq!(c.replies.remove(&write), Some(Reply::Done(Ok(()))));
    let mut config = c.core.config().clone();
    config.quorum = 3;
    let err = config.validate().unwrap_err();
    assert!(err.contains("local-sync"), "{err}");
    // With e1 gone, e0 and the local-sync e2 are in sync but not a quorum: read-only (writes
    // fail at once instead of waiting for a quorum that cannot come).
    c.crash(1);
    assert_eq!(c.mode(), VolumeMode::ReadOnly);
    let refused = c.write(8192, 3, 4096);
    assert_eq!(c.replies.remove(&refused), Some(Reply::Done(Err(HostError::ReadOnly))));
}

#[test]
fn a_schedule_that_comes_due_during_a_scrub_leaves_no_deadline_in_the_past() {
    let mut c = Cluster::with(3, 2, |cfg| cfg.scrub_interval_ms = 1_000);
    // 4 MiB chunks at 1 MiB/s: the scrub outlasts the schedule.
    c.core.start_scrub(c.now, VOLUME, 1 << 20).expect("a scrub starts");
    c.run();
    c.advance_ms(100); // The schedule is set: due at 1.1 s.
    c.advance_ms(1_500);
    let next = c.core.poll_timeout().expect("a ping or the scrub's next chunk is due");
    assert!(next > c.now, "a deadline in the past would wake the core without pause: {next:?} <= {:?}", c.now);
    let running = c.core.status(c.now).volumes[0].scrubs.last().cloned().expect("a scrub");
    assert!(running.running && running.reason == ScrubReason::Ordered);
}

/// Issue 15: a volume added while running is created on every element with a session (and on
/// one that comes back later, from its hello), takes writes at once, and a new host element
/// that starts over with it (`restart_with_volumes`) serves what it holds. Bad requests change
/// nothing.
#[test]
fn volumes_added_while_running_are_created_everywhere_and_survive_a_restart() {
    let mut c = Cluster::new(3, 2);
    c.crash(2);
    let spec = VolumeSpec { name: "disk#7".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    // Asked first whether it fits: the elements with a session answer; one too large for
    // their storage is refused with each one's reason, and nothing is created.
    let check = |c: &mut Cluster, spec: &VolumeSpec| {
        let token = c.token();
        c.core.check_volumes(c.now, token, vec![spec.clone()]);
        c.run();
        c.replies.remove(&token).expect("answered at once here")
    };
    assert_eq!(check(&mut c, &spec), Reply::Checked(Ok(())));
    let huge = VolumeSpec { name: "huge#6".into(), size_bytes: 4 * SIZE, clone_of: None, at_least: false };
    let Reply::Checked(Err(reason)) = check(&mut c, &huge) else { panic!("a volume larger than the storage fits") };
    assert!(reason.contains("element e0:") && reason.contains("element e1:"), "{reason}");
    assert!(c.elements.iter().all(|e| e.storage.vols.len() == 1));
    let ids = c.core.add_volumes(c.now, vec![("disk".into(), spec.clone())]).expect("added");
    c.run();
    let disk = ids[0];
    assert_eq!(disk, VolumeId(1));
    assert!(c.events.contains(&Event::VolumeCreated { volume: disk }), "{:?}", c.events);
    assert_eq!(c.core.volume_id("disk"), Some(disk));
    let token = c.token();
    c.core.handle_host_write(c.now, token, disk, Op::write(4096, Bytes::from(vec![0x5a; 4096])));
    c.run();
    assert_eq!(c.replies[&token], Reply::Done(Ok(())));
    let held = |e: &TestElement| {
        let v = e.storage.vols.iter().find(|v| v.name == "disk#7")?;
        Some((v.applied(), v.data[4096..8192].to_vec()))
    };
    for i in 0..2 {
        assert_eq!(held(&c.elements[i]), Some((Sequence(1), vec![0x5a; 4096])), "element {i}");
    }
    assert_eq!(held(&c.elements[2]), None, "down when the volume was added");
    // It comes back: its hello names the volume, and the write reaches it from the queue.
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(held(&c.elements[2]), Some((Sequence(1), vec![0x5a; 4096])));
    // Refused, changing nothing: a taken name, a bad size, read-only.
    let n = c.core.status(c.now).volumes.len();
    let again = VolumeSpec { name: "disk#8".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    assert!(c.core.add_volumes(c.now, vec![("disk".into(), again)]).is_err());
    let odd = VolumeSpec { name: "odd#9".into(), size_bytes: 1000, clone_of: None, at_least: false };
    assert!(c.core.add_volumes(c.now, vec![("odd".into(), odd)]).is_err());
    c.crash(1);
    c.crash(2);
    let late = VolumeSpec { name: "late#10".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    let refused = c.core.add_volumes(c.now, vec![("late".into(), late)]).expect_err("read-only");
    assert!(refused.contains("read-only"), "{refused}");
    assert_eq!(c.core.status(c.now).volumes.len(), n);
    c.connect(1);
    c.connect(2);
    // A new host element, configured with vol0 only, starts over with the volume it learns
    // of (as from the catalog): the elements hold its data, and it is read back.
    let epoch = c.core.epoch().0;
    c.core.config.volumes.truncate(1);
    c.core.config.exports.clear();
    c.new_host(epoch + 1, 99, &[0, 1, 2]);
    assert_eq!(c.core.status(c.now).volumes.len(), 1);
    c.core.restart_with_volumes(c.now, vec![("disk".into(), spec)], &[], &[], &[]).expect("restarted");
    c.run();
    c.reconnect(&[0, 1, 2]);
    assert_eq!(c.core.status(c.now).volumes.len(), 2);
    let disk = c.core.volume_id("disk").expect("known after the restart");
    let token = c.token();
    c.core.handle_host_read(c.now, token, disk, 4096, 4096);
    c.run();
    let status = c.core.status(c.now);
    let why: Vec<String> = status.elements.iter().map(|e| format!("{} {:?}", e.state, e.failure)).collect();
    assert!(
        c.replies.get(&token) == Some(&Reply::Read(Ok(Bytes::from(vec![0x5a; 4096])))),
        "the volume's data after the restart: {why:?} {:?}",
        &c.events[c.events.len().saturating_sub(12)..]
    );
}

/// Issue 15: a volume removed while running stops taking requests, is removed from every
/// element with a session at once (after its writes), and from one that was down when its
/// next hello names it by a placeholder; a new host element that starts over with the
/// placeholder (a pending deletion in the catalog) has the elements remove it too. Bad
/// requests change nothing.
#[test]
fn volumes_removed_while_running_leave_every_element() {
    let mut c = Cluster::new(3, 2);
    let spec = VolumeSpec { name: "disk#7".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    let disk = c.core.add_volumes(c.now, vec![("disk".into(), spec.clone())]).expect("added")[0];
    c.run();
    let token = c.token();
    c.core.handle_host_write(c.now, token, disk, Op::write(4096, Bytes::from(vec![0x5a; 4096])));
    c.run();
    assert_eq!(c.replies[&token], Reply::Done(Ok(())));
    let holds = |c: &Cluster, i: usize| c.elements[i].storage.vols.iter().any(|v| v.name == "disk#7" && !v.removed);
    assert!((0..3).all(|i| holds(&c, i)));
    // Refused, changing nothing: an unknown volume, and writes under way.
    assert!(c.core.remove_volumes(c.now, vec!["nope#1".into()]).is_err());
    let busy = c.token();
    c.core.handle_host_write(c.now, busy, disk, Op::write(0, Bytes::from(vec![1; 4096])));
    let refused = c.core.remove_volumes(c.now, vec!["disk#7".into()]).expect_err("writes under way");
    assert!(refused.contains("writes under way"), "{refused}");
    c.run();
    assert_eq!(c.replies[&busy], Reply::Done(Ok(())));
    // Element 2 is down: the others remove it now, and the live ones are told so.
    c.crash(2);
    let ids = c.core.remove_volumes(c.now, vec!["disk#7".into()]).expect("removed");
    assert_eq!(ids, vec![disk]);
    c.run();
    assert!(!holds(&c, 0) && !holds(&c, 1) && holds(&c, 2));
    assert!(c.events.contains(&Event::VolumeRemoved { volume: disk, everywhere: false }), "{:?}", c.events);
    assert!(!c.events.contains(&Event::VolumeRemoved { volume: disk, everywhere: true }));
    assert_eq!(c.core.volume_id("disk"), None, "no longer exported");
    assert!(c.core.config().exported().iter().all(|e| e.name != "disk"));
    assert!(c.core.remove_volumes(c.now, vec!["disk#7".into()]).is_err(), "removed once");
    // It comes back: its hello names the volume by a placeholder; it removes it first.
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert!(!holds(&c, 2));
    assert!(c.events.contains(&Event::VolumeRemoved { volume: disk, everywhere: true }), "{:?}", c.events);
    // The other volume still takes writes.
    let token = c.token();
    c.core.handle_host_write(c.now, token, VolumeId(0), Op::write(0, Bytes::from(vec![7; 4096])));
    c.run();
    assert_eq!(c.replies[&token], Reply::Done(Ok(())));
    // A deletion found pending by a new host element: a second volume, removed while
    // element 1 is down, then a new host element with the placeholder.
    let other = VolumeSpec { name: "other#9".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    c.core.add_volumes(c.now, vec![("other".into(), other)]).expect("added");
    c.run();
    c.crash(1);
    c.core.remove_volumes(c.now, vec!["other#9".into()]).expect("removed");
    c.run();
    let held_other =
        |c: &Cluster, i: usize| c.elements[i].storage.vols.iter().any(|v| v.name == "other#9" && !v.removed);
    assert!(held_other(&c, 1) && !held_other(&c, 0));
    let epoch = c.core.epoch().0;
    c.core.config.volumes.truncate(1);
    c.core.config.exports.clear();
    c.new_host(epoch + 1, 99, &[0, 2]);
    let placeholder = VolumeSpec { name: "other#9".into(), size_bytes: 0, clone_of: None, at_least: false };
    c.core.restart_with_volumes(c.now, vec![("other".into(), placeholder)], &[], &[], &[]).expect("restarted");
    c.run();
    c.reconnect(&[0, 1, 2]);
    assert!(!held_other(&c, 1), "the element that was down removed it from the new host element's hello");
    assert_eq!(c.core.volume_id("other"), None);
}

/// Issue 15: a volume grown while running grows on every element with a session, in its
/// stream (a write into the new blocks sent right after the resize is applied), and on one
/// that was down when its next hello names the new size; `Event::VolumeResized` says when Q
/// elements hold it. Bad requests change nothing.
#[test]
fn volumes_grown_while_running_grow_on_every_element_and_take_writes_beyond_the_old_end() {
    let mut c = Cluster::new(3, 2);
    let spec = VolumeSpec { name: "disk#7".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    let disk = c.core.add_volumes(c.now, vec![("disk".into(), spec)]).expect("added")[0];
    c.run();
    let size_on = |c: &Cluster, i: usize| {
        c.elements[i].storage.vols.iter().find(|v| v.name == "disk#7").map(|v| v.data.len() as u64)
    };
    // Refused, changing nothing: an unknown volume, a size not larger, a size not of blocks.
    assert!(c.core.resize_volume(c.now, "nope#1", 2 << 20, 2 << 20).is_err());
    let smaller = c.core.resize_volume(c.now, "disk#7", 4096, 4096).expect_err("storage smaller");
    assert!(smaller.contains("never shrinks"), "{smaller}");
    assert!(c
        .core
        .resize_volume(c.now, "disk#7", 1 << 20, 2 << 20)
        .expect_err("export past")
        .contains("cannot export"));
    assert!(c.core.resize_volume(c.now, "disk#7", (2 << 20) + 512, (2 << 20) + 512).is_err());
    assert_eq!(c.core.config().volumes[disk.0 as usize].size_bytes, 1 << 20);
    // Element 2 is down. A write under way at the resize, and one into the new blocks right
    // after it: the elements grow the volume first.
    c.crash(2);
    let before = c.token();
    c.core.handle_host_write(c.now, before, disk, Op::write(0, Bytes::from(vec![0x11; 4096])));
    assert_eq!(c.core.resize_volume(c.now, "disk#7", 4 << 20, 4 << 20), Ok(disk));
    assert!(c
        .core
        .resize_volume(c.now, "disk#7", 8 << 20, 8 << 20)
        .expect_err("one at a time")
        .contains("being resized"));
    assert!(c.core.config().exported().iter().any(|e| e.name == "disk" && e.size_bytes == 4 << 20));
    let beyond = c.token();
    c.core.handle_host_write(c.now, beyond, disk, Op::write(3 << 20, Bytes::from(vec![0x22; 8192])));
    c.run();
    assert_eq!(c.replies[&before], Reply::Done(Ok(())));
    assert_eq!(c.replies[&beyond], Reply::Done(Ok(())));
    assert!(c.events.contains(&Event::VolumeResized { volume: disk, size_bytes: 4 << 20 }), "{:?}", c.events);
    assert_eq!((size_on(&c, 0), size_on(&c, 1), size_on(&c, 2)), (Some(4 << 20), Some(4 << 20), Some(1 << 20)));
    // It comes back: its hello names the new size; it grows, catches up, holds the data.
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(size_on(&c, 2), Some(4 << 20));
    let v = c.elements[2].storage.vols.iter().find(|v| v.name == "disk#7").expect("held");
    assert_eq!(&v.data[3 << 20..(3 << 20) + 8192], &[0x22; 8192][..]);
    // It grows again, now with every element in session.
    c.core.resize_volume(c.now, "disk#7", 8 << 20, 8 << 20).expect("grown again");
    c.run();
    assert!(c.events.contains(&Event::VolumeResized { volume: disk, size_bytes: 8 << 20 }));
    assert!((0..3).all(|i| size_on(&c, i) == Some(8 << 20)));
}

/// A resize within the storage volume changes only the export: the storage keeps its size on
/// every element and `Event::VolumeResized` comes at once. A start over serves a shrunk
/// export at its size.
#[test]
fn a_resize_within_the_storage_volume_changes_only_the_export() {
    let mut c = Cluster::new(3, 2);
    let spec = VolumeSpec { name: "disk#3".into(), size_bytes: 2 << 20, clone_of: None, at_least: false };
    let disk = c.core.add_volumes(c.now, vec![("disk".into(), spec.clone())]).expect("added")[0];
    c.run();
    let export = |c: &Cluster| c.core.config().exported().iter().find(|e| e.name == "disk").map(|e| e.size_bytes);
    let sent = c.elements.iter().map(|e| e.storage.vols.len()).sum::<usize>();
    c.core.resize_volume(c.now, "disk#3", 2 << 20, 1 << 20).expect("shrunk");
    assert!(c
        .core
        .poll_action()
        .is_some_and(|a| a == Action::Event(Event::VolumeResized { volume: disk, size_bytes: 1 << 20 })));
    assert_eq!(export(&c), Some(1 << 20));
    assert_eq!(c.core.config().volumes[disk.0 as usize].size_bytes, 2 << 20, "the storage keeps its size");
    c.run();
    let sizes: Vec<Option<u64>> = (0..3)
        .map(|i| c.elements[i].storage.vols.iter().find(|v| v.name == "disk#3").map(|v| v.data.len() as u64))
        .collect();
    assert_eq!(sizes, [Some(2 << 20); 3]);
    assert_eq!(c.elements.iter().map(|e| e.storage.vols.len()).sum::<usize>(), sent);
    // Grown back within the storage, then a start over that serves it shrunk.
    c.core.resize_volume(c.now, "disk#3", 2 << 20, 3 << 19).expect("grown back");
    assert_eq!(export(&c), Some(3 << 19));
    c.run();
    c.core.restart(c.now, Epoch(9), ElementId(0), Epoch(8));
    c.run();
    let bad =
        c.core.restart_with_volumes(c.now, vec![("disk".into(), spec.clone())], &[("else#1".into(), 4096)], &[], &[]);
    assert!(bad.is_err());
    c.core
        .restart_with_volumes(c.now, vec![("disk".into(), spec)], &[("disk#3".into(), 1 << 20)], &[], &[])
        .expect("restarted");
    assert_eq!(export(&c), Some(1 << 20));
    assert_eq!(c.core.config().volumes.iter().find(|v| v.name == "disk#3").map(|v| v.size_bytes), Some(2 << 20));
}

/// A takeover (`restart`, above an epoch whose owner is gone) starts over with the volumes the
/// host element was started with, not those it learnt while running: the one it takes over
/// from may have deleted them since (the driver reads the catalog again and adds what it
/// holds with `restart_with_volumes`). Each start over keeps that configuration.
#[test]
fn a_takeover_starts_over_with_the_configured_volumes_only() {
    let mut c = Cluster::new(3, 2);
    let spec = VolumeSpec { name: "disk#1".into(), size_bytes: 1 << 20, clone_of: None, at_least: false };
    c.core.add_volumes(c.now, vec![("disk".into(), spec.clone())]).expect("added");
    c.run();
    let names = |c: &Cluster| c.core.config().volumes.iter().map(|v| v.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&c), ["vol0", "disk#1"]);
    c.core.restart(c.now, Epoch(9), ElementId(0), Epoch(8));
    assert_eq!(names(&c), ["vol0"], "the configured volumes only");
    assert_eq!(c.core.config().exported().iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["vol0"]);
    assert_eq!(c.core.takeovers(), 1);
    c.run();
    assert!(c.events.iter().any(|e| matches!(e, Event::Restarted { to: Epoch(9), .. })), "{:?}", c.events);
    // The catalog read again names the volume: served again, under a newer epoch.
    c.core.restart_with_volumes(c.now, vec![("disk".into(), spec)], &[], &[], &[]).expect("restarted");
    assert_eq!(names(&c), ["vol0", "disk#1"]);
    assert_eq!(c.core.epoch(), Epoch(10));
    assert_eq!(c.core.takeovers(), 1, "not a takeover");
    // A later takeover drops it again: the configuration survived the start over.
    c.core.restart(c.now, Epoch(12), ElementId(1), Epoch(11));
    assert_eq!(names(&c), ["vol0"]);
    assert_eq!(c.core.takeovers(), 2);
}

/// A snapshot is a record in the volume's stream: its read returns the volume as it was then
/// (not the newer writes the cache and queue hold), and an element that does not hold it (as
/// after a full recovery) is passed over, not failed.
#[test]
fn a_snapshot_reads_as_its_volume_was_and_an_element_without_it_is_passed_over() {
    let mut c = Cluster::new(3, 2);
    c.write(0, 1, 8192);
    let token = c.token();
    c.core.handle_host_write(c.now, token, VOLUME, Op::Snapshot { id: 7 });
    c.run();
    assert_eq!(c.replies.remove(&token), Some(Reply::Done(Ok(()))));
    let taken_at = c.core.status(c.now).volumes[0].acked_sequence;
    c.write(4096, 2, 4096);
    // Read once, so the cache holds the newer content too.
    assert!(matches!(c.read(0, 8192), Reply::Read(Ok(d)) if d[4096..] == [2u8; 4096][..]));
    for e in &c.elements {
        assert!(e.storage.snapshot_index(0, 7).is_some(), "every element took it");
    }
    let si = c.elements[0].storage.snapshot_index(0, 7).expect("taken");
    c.elements[0].storage.vols[si].removed = true;
    let token = c.token();
    let snapshot = SnapshotRef { id: 7, taken_at };
    c.core.handle_host_snapshot_read(c.now, token, VOLUME, snapshot, 0, 8192);
    c.run();
    match c.replies.remove(&token) {
        Some(Reply::Read(Ok(data))) => assert_eq!(&data[..], &[1u8; 8192][..], "the volume as it was"),
        other => panic!("the snapshot read is answered by another element: {other:?}"),
    }
    let refused = |e: &Event| matches!(e, Event::SnapshotReadRefused { element: ElementId(0), id: 7, .. });
    assert!(c.events.iter().any(refused), "{:?}", c.events);
    assert!(!c.events.iter().any(|e| matches!(e, Event::ElementFailed { .. })), "no element failed");
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    // A snapshot no element holds is unavailable, not wrong data.
    let token = c.token();
    c.core.handle_host_snapshot_block_status(c.now, token, VOLUME, SnapshotRef { id: 8, taken_at }, 0, 8192);
    c.run();
    assert_eq!(c.replies.remove(&token), Some(Reply::BlockStatus(Err(HostError::Unavailable))));
}

/// Issue 15: a clone added while an element with a session lacks its snapshot (it has not
/// taken it yet): that element creates the clone empty and says it must be copied; the host
/// element fails it (`CloneNeedsCopy`) without failing the creation, and its next session
/// copies the clone whole, which then holds the snapshot's content there too.
#[test]
fn a_clone_an_element_cannot_share_yet_reaches_it_by_a_full_recovery() {
    let mut c = Cluster::new(3, 2);
    c.write(0, 3, 8192);
    let token = c.token();
    c.core.handle_host_write(c.now, token, VOLUME, Op::Snapshot { id: 9 });
    c.run();
    assert_eq!(c.replies.remove(&token), Some(Reply::Done(Ok(()))));
    c.write(0, 4, 4096);
    // e2 "has not taken it yet" (it would be replaying the volume).
    let si = c.elements[2].storage.snapshot_index(0, 9).expect("taken");
    c.elements[2].storage.vols[si].removed = true;
    let base = proto::CloneBase { volume: "vol0".into(), snapshot: 9 };
    let spec = VolumeSpec { name: "copy#10".into(), size_bytes: SIZE, clone_of: Some(base), at_least: false };
    let ids = c.core.add_volumes(c.now, vec![("copy".into(), spec)]).expect("added");
    c.run();
    assert!(c.events.contains(&Event::VolumeCreated { volume: ids[0] }), "e0 and e1 hold it: {:?}", c.events);
    let failed = |e: &Event| matches!(e, Event::ElementFailed { element: ElementId(2), reason: Failure::CloneNeedsCopy { volume } } if volume == "copy#10");
    assert!(c.events.iter().any(failed), "{:?}", c.events);
    let clone_data = |c: &Cluster, i: usize| {
        let v = c.elements[i].storage.vols.iter().find(|v| v.name == "copy#10" && !v.removed).expect("created");
        v.data[..8192].to_vec()
    };
    assert_eq!(clone_data(&c, 0), vec![3u8; 8192], "shared: the snapshot's content, not the newer write");
    c.connect(2);
    assert_eq!(c.states(), "in-sync,in-sync,in-sync");
    assert_eq!(c.elements[2].copies, 1, "the clone was copied to e2");
    assert_eq!(clone_data(&c, 2), vec![3u8; 8192], "copied: the snapshot's content");
}

/// Member `name` of consistency group `g` in storage volume 0: 1 MiB at `offset_bytes`.
fn group_member(name: &str, offset_bytes: u64) -> crate::groups::ExportedVolume {
    crate::groups::ExportedVolume {
        name: name.into(),
        group: Some("g".into()),
        volume: 0,
        offset_bytes,
        size_bytes: 1 << 20,
        snapshot: None,
    }
}

/// Issue 15: a consistency group's snapshot is exported per member, as `M@NAME`, each the
/// member's window (offset and size) of the group's storage volume's snapshot; removing the
/// group's snapshot export removes every member's, and the members' own exports stay.
#[test]
fn a_groups_snapshot_is_exported_per_member_and_removed_whole() {
    let mut c = Cluster::with(3, 2, |config| config.exports = vec![group_member("a", 0), group_member("b", 1 << 20)]);
    let reference = SnapshotRef { id: 4, taken_at: Sequence(9) };
    c.core.add_snapshot_export("g@s".into(), "g", reference, 2 << 20).expect("exported");
    let exports = c.core.config().exports.clone();
    let of = |name: &str| exports.iter().find(|e| e.name == name).cloned();
    let a = of("a@s").expect("a@s");
    let b = of("b@s").expect("b@s");
    assert_eq!((a.offset_bytes, a.size_bytes, a.snapshot), (0, 1 << 20, Some(reference)));
    assert_eq!((b.offset_bytes, b.size_bytes, b.group.as_deref()), (1 << 20, 1 << 20, Some("g")));
    assert!(of("g@s").is_none(), "the group itself is no export");
    // Again (a catalog read again): nothing doubles.
    c.core.add_snapshot_export("g@s".into(), "g", reference, 2 << 20).expect("exported");
    assert_eq!(c.core.config().exports.len(), 4);
    c.core.remove_snapshot_export("g@s");
    let names: Vec<String> = c.core.config().exports.iter().map(|e| e.name.clone()).collect();
    assert_eq!(names, vec!["a".to_string(), "b".to_string()]);
}

/// Issue 15: a volume joins a consistency group while running (`join_group`): exported at once
/// as a window past the members, while the group's storage volume grows in every element's
/// stream (`VolumeResized` once Q hold it; an element that was down grows it from its hello).
/// A snapshot taken before the join does not export it, one after does. A window that overlaps
/// a member, a name taken, or a group that is not carried there is refused, changing nothing.
/// Leaving removes its export and its snapshot exports; a restart with it serves it again.
#[test]
fn a_volume_joins_a_group_past_its_members_and_leaves_it() {
    let mut c = Cluster::with(3, 2, |config| config.exports = vec![group_member("a", 0), group_member("b", 1 << 20)]);
    c.crash(2);
    let joined = crate::groups::JoinedMember {
        name: "log".into(),
        group: "g".into(),
        storage: "vol0".into(),
        offset_bytes: SIZE,
        size_bytes: 1 << 20,
    };
    let before = c.core.config().clone();
    for (bad, why) in [
        (crate::groups::JoinedMember { offset_bytes: 1 << 20, ..joined.clone() }, "overlap"),
        (crate::groups::JoinedMember { name: "a".into(), ..joined.clone() }, "exists"),
        (crate::groups::JoinedMember { group: "h".into(), ..joined.clone() }, "no consistency group h"),
        (crate::groups::JoinedMember { storage: "vol9".into(), ..joined.clone() }, "not served"),
    ] {
        let refused = c.core.join_group(c.now, bad).expect_err("refused");
        assert!(refused.contains(why), "{refused}");
        let now = (&c.core.config().volumes, &c.core.config().exports);
        assert_eq!(now, (&before.volumes, &before.exports), "a refused join changes nothing");
    }
    let id = c.core.join_group(c.now, joined.clone()).expect("joined");
    c.run();
    let grown = SIZE + (1 << 20);
    let resized = c
        .events
        .iter()
        .any(|e| matches!(e, Event::VolumeResized { volume, size_bytes } if *volume == id && *size_bytes == grown));
    assert!(resized, "Q elements hold the grown storage volume: {:?}", c.events);
    for i in 0..2 {
        assert_eq!(c.elements[i].storage.vols[0].data.len() as u64, grown, "e{i} grew it in its stream");
    }
    c.connect(2);
    assert_eq!(c.elements[2].storage.vols[0].data.len() as u64, grown, "e2 grew it from its hello");
    let log = c.core.config().exports.iter().find(|e| e.name == "log").cloned().expect("exported");
    assert_eq!((log.offset_bytes, log.size_bytes, log.group.as_deref()), (SIZE, 1 << 20, Some("g")));
    let reference = SnapshotRef { id: 4, taken_at: Sequence(9) };
    c.core.add_snapshot_export("g@before".into(), "g", reference, SIZE).expect("exported");
    c.core.add_snapshot_export("g@after".into(), "g", SnapshotRef { id: 5, ..reference }, grown).expect("exported");
    let names = |c: &Cluster| -> Vec<String> { c.core.config().exports.iter().map(|e| e.name.clone()).collect() };
    assert!(!names(&c).contains(&"log@before".to_string()), "joined after the snapshot: not in it");
    assert!(names(&c).contains(&"log@after".to_string()));
    assert_eq!(c.core.leave_group("log").expect("left"), id);
    assert!(c.core.leave_group("log").is_err(), "left already");
    let left = names(&c);
    assert!(!left.iter().any(|n| n.starts_with("log")), "{left:?}");
    assert!(left.contains(&"a@after".to_string()) && left.contains(&"b".to_string()), "{left:?}");
    // A host element that starts with the catalog's member and the group's grown size.
    c.core
        .restart_with_volumes(c.now, Vec::new(), &[], &[joined], &[("vol0".into(), grown + (1 << 20))])
        .expect("restarted");
    assert_eq!(c.core.config().volumes[0].size_bytes, grown + (1 << 20), "never smaller than it grew to");
    assert!(names(&c).contains(&"log".to_string()));
}

/// Issue 15: a consistency group's storage volume (named `at_least`) that an element holds
/// larger than this host element serves it (it grew as a volume joined the group, and this
/// host element has not read its catalog yet) is adopted at that size, and grown on the other
/// elements in their streams, so that an element that missed the growth can take what was
/// written there.
#[test]
fn a_groups_storage_volume_held_larger_is_adopted_and_grown_everywhere() {
    let mut c = Cluster::with(3, 2, |config| config.volumes[0].at_least = true);
    let grown = SIZE + (1 << 20);
    c.crash(2);
    c.elements[2].storage.resize_volume(LocalVolume(0), grown).expect("grown");
    c.connect(2);
    assert_eq!(c.core.config().volumes[0].size_bytes, grown, "adopted");
    for i in 0..3 {
        assert_eq!(c.elements[i].storage.vols[0].data.len() as u64, grown, "e{i} holds it grown");
    }
    assert!(c.core.status(c.now).elements.iter().all(|e| e.state == "in-sync"), "no element failed on the way");
}

/// Faults that follow the one that failed an element in its session (an element refuses a
/// burst of records one by one) count as that one failure, and its reason stands.
#[test]
fn faults_after_the_first_in_a_session_count_as_one_failure() {
    let mut c = Cluster::new(3, 2);
    for n in 0..3 {
        let reason = format!("fault number {n}");
        c.core.handle_element_message(c.now, ElementId(1), ElementMessage::Fault { reason });
    }
    let status = c.core.status(c.now);
    let e = &status.elements[1];
    assert_eq!(e.failures, vec![("fault", 1)], "{e:?}");
    assert!(e.reason.as_deref().unwrap_or("").contains("fault number 0"), "{e:?}");
}

fn welcome(applied: u64, copying: bool) -> ElementMessage {
    ElementMessage::Welcome {
        epoch: Epoch(6),
        element_id: 0,
        volumes: vec![VolumeState {
            applied_sequence: if copying { Sequence::ZERO } else { Sequence(applied) },
            applied_epoch: if copying { Epoch(0) } else { Epoch(6) },
            copying,
            repair: false,
            size_bytes: SIZE,
        }],
    }
}

/// The start-up set meets every write quorum only if its members hold their volumes: an
/// element whose full recovery was interrupted (`copying`) holds none of the writes it
/// acknowledged before its copy began, so it does not count. The simulator found the loss
/// (swarm seed 273): a repair whose copy failed, and a host element that started with it and
/// an element behind, without the one that held the newest acknowledged writes.
#[test]
fn a_starting_host_element_does_not_count_an_element_being_copied() {
    let mut config = HostConfig::new(
        Epoch(7),
        2,
        (0..3).map(|i| format!("e{i}")).collect(),
        vec![VolumeSpec { name: "vol0".into(), size_bytes: SIZE, clone_of: None, at_least: false }],
    );
    config.element_addresses = (0..3).map(|i| format!("e{i}")).collect();
    let grace_ms = config.startup_grace_ms;
    let mut core = HostCore::new(config, Time(0));
    for i in 0..3 {
        core.handle_element_connected(Time(0), ElementId(i));
    }
    core.handle_element_message(Time(0), ElementId(0), welcome(5, false));
    core.handle_element_message(Time(0), ElementId(1), welcome(9, true));
    let fetches = |core: &mut HostCore| {
        let mut to = Vec::new();
        while let Some(action) = core.poll_action() {
            if let Action::Send { to: set, message: HostMessage::FetchLog { after, .. } } = action {
                to.extend(set.iter().map(|e| (e.0, after)));
            }
        }
        to
    };
    fetches(&mut core);
    let after_grace = Time(grace_ms * 1000 + 1);
    core.handle_timeout(after_grace);
    assert_eq!(fetches(&mut core), vec![], "two welcomed, but one of them holds nothing of vol0: no start");
    assert!(!core.status(after_grace).ready);
    // The one that holds the newest writes comes: the sequence goes on from it, and what e0
    // misses is fetched from it (nothing from the one being copied).
    core.handle_element_message(after_grace, ElementId(2), welcome(9, false));
    assert_eq!(fetches(&mut core), vec![(2, Sequence(4))]);
}
